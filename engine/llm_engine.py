"""The engine: requests in, per-step token deltas out.

``add_request`` validates and queues, ``step`` runs one scheduler iteration (one forward pass
over a mixed batch) and returns what each request produced, ``abort`` frees a request's blocks
at once. All three are thread-safe, so a service can run ``step`` in its own thread while its
event loop adds and aborts requests. With async scheduling (on by default) ``step`` launches
the next forward pass before it reads back the previous one, and returns that one's outputs
(``engine.step_loop``).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch

from engine.adapters import Adapters
from engine.choices import RequestTables
from engine.config import EngineConfig, ModelConfig
from engine.draft_model import DraftProposer
from engine.emit import Emitter
from engine.errors import RequestNotFoundError
from engine.handoff import Handoff
from engine.host_store import disk_tier_stats, make_tier, tier_stats
from engine.intake import Intake
from engine.lora_config import LoRASpec
from engine.model_runner import ModelRunner
from engine.ngram import NgramProposer, Proposer
from engine.parallel.ranks import RankGroup, start_ranks
from engine.pooling import PoolingConfig, PromptPasses
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams, TokenLogprob
from engine.scheduler import Scheduler
from engine.step_loop import Stepper
from engine.step_stats import SpecStats, StepObserver, prefill_backlog
from engine.structured import GrammarRuntime
from engine.tokenizer import Tokenizer
from engine.warmup import warm_up
from kernels import compile_counter
from kernels.compile_counter import CompileCounts
from libkv.block_pool import BlockPool
from libkv.host_tier import TierStats
from libkv.kv_manager import KVCacheManager


@dataclass(slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    num_preemptions: int
    prefix_hit_tokens: int
    prompt_tokens: int
    spec: SpecStats = field(default_factory=SpecStats)
    # Prompt tokens (or recomputed ones after a preemption) queued or part-computed: what a
    # router weighs to place a new prompt (services.router.disagg).
    prefill_backlog: int = 0
    # Triton kernel specialisations this process met before and after ready (plain numbers).
    kernel_compiles: CompileCounts = field(default_factory=CompileCounts)
    tier: TierStats | None = None  # the host tier's counters (None: no host tier)
    disk_tier: TierStats | None = None  # the disk tier's counters (None: no disk tier)


class LLMEngine:
    """Continuous-batching engine over one model.

    Parts it holds, each given what it needs when built: ``adapters`` (``engine.adapters``),
    ``intake`` (``engine.intake``: checks, choices, queueing), ``emitter`` (``engine.emit``:
    outputs from sampled tokens), the passes over one prompt alone (``engine.pooling``),
    ``stepper`` (``engine.step_loop``: ``step``, async scheduling; its ``overlapped_steps``
    and ``dropped_tokens`` count what async scheduling did) and ``handoff``
    (``engine.handoff``: KV moved between workers: ``reserve``, ``add_prefilled``,
    ``release``, ...; callers use it directly). ``tables`` (``engine.choices.RequestTables``),
    the live, reserved and held requests, is shared by them; the lock too."""

    def __init__(self, config: EngineConfig) -> None:
        compile_counter.COUNTER.start_build()  # compiles until mark_ready below: the build's
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        mc = self.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.tokenizer = Tokenizer(config.model_dir)
        self.pooling = PoolingConfig.from_dir(config.model_dir)
        self.ranks: RankGroup | None = None  # tensor parallelism: ranks 1..N-1
        if config.tensor_parallel_size > 1:
            self.ranks = start_ranks(config, mc, self.max_model_len)
        spec = config.speculative_config
        draft_dir = spec.model if spec is not None and spec.method == "draft_model" else None
        try:
            comm = self.ranks.comm if self.ranks else None
            draft = ModelConfig.from_dir(draft_dir) if draft_dir else None
            self.runner = ModelRunner(config, mc, self.max_model_len, comm, self.ranks, draft)
            warm_up(self.runner, self.max_model_len)
        except BaseException:
            self.close()
            raise
        self._lock = threading.RLock()
        self.tables = RequestTables()
        self.adapters = Adapters(self.runner, self._lock, self.tables.requests)
        self.pool = BlockPool(self.runner.num_blocks, config.block_size)
        self.kv = KVCacheManager(
            self.pool, config.enable_prefix_caching, track_seals=config.seal_checksums
        )
        self.kv.set_tier(make_tier(config, self.runner.host_store, self.runner.layout.block_bytes))
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_loras if config.enable_lora else 0,
            self.max_model_len,
        )
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammar = GrammarRuntime(self.tokenizer.hf.to_str(), mc.vocab_size, sorted(eos))
        t = self.tables
        self.intake = Intake(
            config, mc.vocab_size, self.max_model_len, self.tokenizer, self.runner, self.kv,
            self.scheduler, self.grammar, self._lock, t, self.eos_token_ids, self.adapters.check,
        )  # fmt: skip
        self._passes = PromptPasses(
            config, self.kv, self.runner, self.pooling, self._lock, self.intake.counter,
            self.intake.validate, self.adapters.check,
        )  # fmt: skip
        proposer: Proposer | None = None
        if spec is not None and draft_dir:
            proposer = DraftProposer(
                config, mc, self.tokenizer, self.max_model_len, self.runner.num_blocks
            )
        elif spec is not None:
            proposer = NgramProposer.of(spec)
        self.emitter = Emitter(
            self.scheduler, t.requests, t.held, t.held_seqs, self.max_model_len, self.eos_token_ids
        )
        self.stepper = Stepper(
            config, self.scheduler, self.runner, self.kv, self.grammar, self.emitter, self._lock,
            t.requests, proposer, self.ranks, self.max_model_len, self.intake.choice_of,
            self.adapters.drop_unused,
        )  # fmt: skip
        self.handoff = Handoff(
            config, self.kv, self.runner, self.scheduler, self.grammar, self._lock, t,
            self.stepper, self.max_model_len, self.intake.validate, self.intake.new_choice,
            self.adapters.check,
        )  # fmt: skip
        # Built and warmed up (``engine.warmup``, in each ModelRunner): a kernel compiled from
        # now on is a serving stall, counted and logged as one.
        compile_counter.COUNTER.mark_ready()

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        tenant: str | None = None,
        hold_kv: bool = False,
        priority: int = 0,
        lora: str | None = None,
    ) -> None:
        """Validate and queue a request. ``tenant`` salts its cache keys (no cross-tenant hits).
        ``lora`` names a loaded adapter to run with (AdapterNotFoundError otherwise); it salts
        the cache keys too, since the same tokens give other KV under another adapter.
        ``priority``: 0 (interactive) is scheduled before 1 (batch), which is preempted first.

        ``hold_kv`` makes it a prefill: after the first tokens (one per choice) the request
        leaves the batch but keeps its prompt's blocks (outputs ``kv_held``) until
        ``handoff.release``;
        unless every choice already finished.
        """
        self.intake.add(
            request_id, prompt, params, tenant=tenant, hold_kv=hold_kv, priority=priority,
            lora=lora,
        )  # fmt: skip

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (every choice) and free its blocks now (held or reserved blocks too;
        then None). Returns the output of its lowest live choice.

        Raises RequestNotFoundError if the id is unknown."""
        with self._lock:
            req = self.tables.requests.pop(request_id, None)
            if req is None:
                if self.handoff.release(request_id):
                    return None
                raise RequestNotFoundError(f"no live request {request_id!r}")
            outs = []
            for index in sorted(req.live):
                choice = req.live[index]
                self.scheduler.abort(choice.seq)
                outs.append(self.emitter.output(choice, [], "", []))
            self.adapters.drop_unused()
            if self.proposer is not None:
                self.proposer.retain(self.scheduler.running)
            self.stepper.settle_if_idle()  # (emits nothing: no live sequence was in it)
            return outs[0] if outs else None

    # -- the step loop (``engine.step_loop``) ---------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: this step's outputs, or with async scheduling the previous one's
        (``Stepper.step``)."""
        return self.stepper.step()

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has work: sequences to run, or a step in flight to read back."""
        return self.stepper.has_unfinished()

    def hold_planning(self, wake: threading.Event) -> float:
        """Before the next ``step()``, with late planning: wait until the step in flight nearly
        ends or ``wake`` is set (``Stepper.hold``); the seconds waited."""
        return self.stepper.hold(wake)

    @property
    def proposer(self) -> Proposer | None:
        """Speculative decoding's draft proposer (None without); may be replaced between steps."""
        return self.stepper.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        self.stepper.proposer = proposer

    @property
    def on_step(self) -> StepObserver | None:
        """Called with each step's StepStats when set."""
        return self.stepper.on_step

    @on_step.setter
    def on_step(self, observer: StepObserver | None) -> None:
        self.stepper.on_step = observer

    # -- LoRA adapters (``engine.adapters``) ----------------------------------------------------
    def add_lora(self, name: str, path: str) -> LoRASpec:
        """Load a PEFT adapter folder under ``name``; requests then name it as their adapter.

        Raises InvalidAdapterError with the reason when the folder cannot be served."""
        return self.adapters.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter: new requests for it fail at once, requests using it finish first.
        Raises AdapterNotFoundError if not loaded."""
        self.adapters.remove(name)

    def list_loras(self) -> list[str]:
        """Names of the loaded adapters (not those being unloaded)."""
        return self.adapters.names()

    # -- one prompt alone (``engine.pooling``) ---------------------------------------------------
    def embed(self, prompt: list[int], lora: str | None = None) -> torch.Tensor:
        """The prompt's embedding (float32 [hidden], on the CPU), pooled by ``self.pooling``."""
        return self._passes.embed(prompt, lora)

    def prompt_logprobs(
        self, prompt: list[int], k: int = 0, lora: str | None = None
    ) -> list[TokenLogprob]:
        """Each prompt token's raw-model logprob and rank after the tokens before it, with the
        ``k`` most likely tokens there (vLLM's ``prompt_logprobs``; the first token has none)."""
        return self._passes.prompt_logprobs(prompt, k, lora)

    def score(self, prompt: list[int], lora: str | None = None) -> torch.Tensor:
        """Float32 logits [len(prompt), vocab] of every prompt position (one paged prefill)."""
        return self._passes.score(prompt, lora)

    # -- introspection ------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                num_waiting=len(self.scheduler.waiting),
                num_running=len(self.scheduler.running),
                kv_blocks_total=self.pool.num_blocks,
                kv_blocks_used=self.pool.num_used,
                kv_blocks_cached=self.pool.num_cached,
                num_preemptions=self.scheduler.num_preemptions,
                prefix_hit_tokens=self.emitter.prefix_hit_tokens,
                prompt_tokens=self.emitter.prompt_tokens,
                spec=self.stepper.spec.copy(),
                kernel_compiles=compile_counter.COUNTER.counts(),
                tier=tier_stats(self.kv.tier, self.runner.host_store),
                disk_tier=disk_tier_stats(self.kv.tier, self.runner.host_store),
                prefill_backlog=prefill_backlog(
                    itertools.chain(self.scheduler.waiting, self.scheduler.running)
                ),
            )

    def try_stats(self, timeout: float) -> EngineStats | None:
        """``stats()``, or None when a step holds the engine for more than ``timeout`` seconds
        (metrics scrapes must not wait behind a long step)."""
        if not self._lock.acquire(timeout=timeout):
            return None
        try:
            return self.stats()
        finally:
            self._lock.release()

    def check_integrity(self) -> None:
        with self._lock:
            self.kv.check_integrity()
            if self.kv.tier is not None:
                self.kv.tier.check_integrity()
            if isinstance(self.proposer, DraftProposer):
                self.proposer.check_integrity()

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do at TP=1); the engine is unusable after.
        Its decode graphs go first: NCCL's shutdown waits for graphs that hold its collectives.
        The disk KV tier's file is removed."""
        if getattr(self, "runner", None) is not None:
            self.runner.close_tiers()
        if self.ranks is not None:
            self.runner.release_graphs()
            self.ranks.close()
