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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.adapters import Adapters
from engine.choices import Choice, Request
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.draft_model import DraftProposer
from engine.emit import Emitter
from engine.errors import (
    InvalidRequestError,
    PromptTooLongError,
    RequestNotFoundError,
)
from engine.handoff import HandoffMixin
from engine.lora_config import LoRASpec
from engine.model_runner import ModelRunner
from engine.ngram import NgramProposer, Proposer
from engine.parallel.ranks import RankGroup, start_ranks
from engine.pooling import PoolingConfig, PromptPasses
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams, TokenLogprob
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_loop import InFlight, StepMixin
from engine.step_stats import SpecStats, StepObserver
from engine.structured import GrammarRuntime
from engine.tokenizer import Tokenizer
from engine.warmup import warm_up
from kernels import compile_counter
from kernels.compile_counter import CompileCounts
from libkv.block_pool import BlockPool
from libkv.hashing import encode_extra_keys
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
    # Triton kernel specialisations this process met before and after ready (plain numbers).
    kernel_compiles: CompileCounts = field(default_factory=CompileCounts)


class LLMEngine(StepMixin, HandoffMixin):
    """Continuous-batching engine over one model.

    Parts it holds, each given what it needs when built: ``adapters`` (``engine.adapters``),
    ``emitter`` (``engine.emit``: outputs from sampled tokens) and the passes over one prompt
    alone (``engine.pooling``); the step loop and the KV hand-off are still mixed in."""

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
        self._requests: dict[str, Request] = {}
        self.adapters = Adapters(self.runner, self._lock, self._requests)
        self.pool = BlockPool(self.runner.num_blocks, config.block_size)
        self.kv = KVCacheManager(
            self.pool, config.enable_prefix_caching, track_seals=config.seal_checksums
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_loras if config.enable_lora else 0,
            self.max_model_len,
        )
        self._inflight: InFlight | None = None  # the step launched and not read back yet
        self._last_read = 0.0  # perf_counter() when a step was last read back
        self.overlapped_steps = 0  # steps left in flight across a step() call
        self.dropped_tokens = 0  # sampled in flight for a sequence that ended meanwhile
        self._reserved: set[str] = set()  # block tables reserved for incoming KV (decode side)
        self._held: set[str] = set()  # block tables held for a decode worker (prefill side)
        self._held_seqs: dict[str, dict[int, Sequence]] = {}
        self._counter = itertools.count()
        self._passes = PromptPasses(
            config, self.kv, self.runner, self.pooling, self._lock, self._counter,
            self._validate, self.adapters.check,
        )  # fmt: skip
        self.proposer: Proposer | None = None
        if spec is not None and draft_dir:
            self.proposer = DraftProposer(
                config, mc, self.tokenizer, self.max_model_len, self.runner.num_blocks
            )
        elif spec is not None:
            self.proposer = NgramProposer.of(spec)
        self._spec = SpecStats(accepted_per_pos=[0] * (spec.num_speculative_tokens if spec else 0))
        self.on_step: StepObserver | None = None  # called with each step's StepStats
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.emitter = Emitter(
            self.scheduler, self._requests, self._held, self._held_seqs, self.max_model_len,
            self.eos_token_ids,
        )  # fmt: skip
        self.grammar = GrammarRuntime(self.tokenizer.hf.to_str(), mc.vocab_size, sorted(eos))
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
        leaves the batch but keeps its prompt's blocks (outputs ``kv_held``) until ``release``;
        unless every choice already finished.
        """
        params = params or SamplingParams()
        ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(ids, params)
        with self._lock:
            adapter = self.check_lora(lora)
        salt = encode_extra_keys(tenant, adapter or None)
        first = self._new_choice(request_id, ids, params, salt, 0, adapter)
        if params.grammar is not None:
            first.seq.matcher = self.grammar.matcher(params.grammar)
        first.seq.priority = priority
        req = Request(first.seq, {0: first}, list(range(1, params.n)), hold_kv)
        with self._lock:
            self._register(req)
            self.scheduler.add(first.seq)

    def _new_choice(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        salt: bytes,
        index: int,
        lora: str = "",
    ) -> Choice:
        seq = Sequence(request_id, ids, params, next(self._counter), salt, index=index, lora=lora)
        return self._choice_of(seq)

    def _choice_of(self, seq: Sequence) -> Choice:
        """A Choice around ``seq``, with its seeded generator (seed + index) and detokenizer."""
        params = seq.params
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(
                (params.seed + seq.index) % 2**64
            )
        if params.min_tokens:
            eos = () if params.ignore_eos else self.eos_token_ids
            seq.stop_ids = tuple(sorted({*params.stop_token_ids, *eos}))
        detok = IncrementalDetokenizer(
            self.tokenizer.hf,
            seq.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        return Choice(seq, detok, [] if params.logprobs is not None else None)

    def _register(self, req: Request) -> None:
        rid = req.request_id
        if rid in self._requests or (rid in self.kv and rid not in self._reserved):
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        self._requests[rid] = req

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias: token ids must be in [0, {vocab})")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the context limit is {limit} tokens "
                "(prompt plus at least one generated token)"
            )
        if len(ids) + params.max_tokens > limit:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} exceeds the context limit of {limit} tokens"
            )
        need = self.kv.blocks_for(len(ids) + params.max_tokens)
        if need > self.pool.num_blocks:
            raise PromptTooLongError(
                f"prompt + max_tokens need {need} KV blocks but the cache holds "
                f"{self.pool.num_blocks} ({self.pool.num_blocks * self.config.block_size} tokens)"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (every choice) and free its blocks now (held or reserved blocks too;
        then None). Returns the output of its lowest live choice.

        Raises RequestNotFoundError if the id is unknown."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            if req is None:
                if self.release(request_id):
                    return None
                raise RequestNotFoundError(f"no live request {request_id!r}")
            outs = []
            for index in sorted(req.live):
                choice = req.live[index]
                self.scheduler.abort(choice.seq)
                outs.append(self.emitter.output(choice, [], "", []))
            self._drop_unused_loras()
            if self.proposer is not None:
                self.proposer.retain(self.scheduler.running)
            self._settle_if_idle()  # (emits nothing: no live sequence was in it)
            return outs[0] if outs else None

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

    def resident_loras(self) -> list[str]:
        """Adapters in device slots now, least recently used first."""
        return self.adapters.resident()

    def check_lora(self, name: str | None) -> str:
        """``name`` if it is a loaded adapter ("" for None or ""); else AdapterNotFoundError."""
        return self.adapters.check(name)

    def _drop_unused_loras(self) -> None:
        self.adapters.drop_unused()

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

    def _alone(self, prompt: list[int], lora: str | None, run: Callable) -> list:
        return self._passes.alone(prompt, lora, run)

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
                spec=self._spec.copy(),
                kernel_compiles=compile_counter.COUNTER.counts(),
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
            if isinstance(self.proposer, DraftProposer):
                self.proposer.check_integrity()

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do at TP=1); the engine is unusable after.
        Its decode graphs go first: NCCL's shutdown waits for graphs that hold its collectives."""
        if self.ranks is not None:
            self.runner.release_graphs()
            self.ranks.close()
