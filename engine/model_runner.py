"""Turns a scheduler step into tensors, runs the model and samples: the only torch user of the
engine's step loop.

Under tensor parallelism every rank has a runner over its shard of the weights and the KV pool.
Rank 0's (the engine's) plans each step and sends the plan to the other ranks (``peers``,
``engine.parallel.ranks``) before running its own part; they run it with ``follow``. A plan is
host data only (token ids, positions, slots, block tables), so every rank builds the same
tensors on its own device and the ranks meet in the model's collectives.

Nothing here waits for the device on the way in: host vectors go up in one pinned,
non-blocking copy (``engine.device_io``), and ``execute`` returns the sampled ids on the device
with their copy to the host under way (``StepSample``). With async scheduling the next step's
inputs are then built, and launched, while this step runs; a sequence whose newest token is
still in flight gets it from the previous step's sampled ids on the device
(``engine.inflight``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

import kernels
from engine import fp8, kv_pool, memory
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeBatch, DecodeGraphs, SpreadGraphs, graph_batch_sizes
from engine.device_io import upload, upload_many
from engine.disk_store import DiskStore, disk_slots
from engine.host_store import HostStore, host_slots, written_blocks
from engine.inflight import InflightIds, feed_ids, step_inputs
from engine.kv_checksum import (
    ALGORITHMS,
    CRC32,
    BlockChecksums,
    SealedSums,
    combine,
    default_algorithm,
)
from engine.loader import dummy_weights, load_weights
from engine.lora import LoRABatch, LoRAManager
from engine.lora_config import LoRASpec
from engine.mixed_graphs import MixedGraphs, mixed_graph_sizes
from engine.model import DecoderModel
from engine.parallel.comm import TPComm
from engine.parallel.devices import rank_device
from engine.parallel.shard import ModelShard
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import TokenLogprob
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.spec_decode import StepSample, VerifyOutput, sample_with_drafts
from engine.structured import GrammarRuntime
from engine.warmup_shapes import WarmupReport
from libkv.host_tier import TierCopies
from libkv.kv_layout import KVLayout
from libkv.kv_manager import CopyOp

log = logging.getLogger(__name__)


class Peers(Protocol):
    """The other ranks, as rank 0's runner drives them (``engine.parallel.ranks.RankGroup``)."""

    def send(self, op: str, args: tuple) -> None:
        """Queue ``follow(op, args)`` on every other rank, in order with the commands before."""

    def step_failed(self) -> None:
        """Rank 0's part of a command raised: end the process if a rank died (``RANK_DIED``)."""


def resolve_device(config: EngineConfig, rank: int = 0) -> torch.device:
    if config.tensor_parallel_size > 1:
        return rank_device(config, rank)
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        config.dtype
    ]


# Logits a prompt-logprobs pass holds at once (float32: 64 MiB), LM head rows at a time.
SCORE_ELEMENTS = 1 << 24


@dataclass(slots=True)
class StepPlan:
    """Host-side inputs of one forward pass over a flattened varlen batch (what rank 0 sends
    the other ranks). ``sample_rows``: rows whose logits are wanted (empty: none)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]  # block * block_size + offset of each token
    query_start: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    max_query_len: int
    sample_rows: list[int]
    loras: list[str] = field(default_factory=list)  # the step's LoRA adapters
    token_loras: list[str] = field(default_factory=list)  # each token's adapter ("": none)
    hidden: bool = False  # return the sample rows' final hidden states instead of logits
    # Per token, the row of the previous step's sampled ids its id comes from (-1: token_ids
    # has it); empty when no token is in flight (always under tensor parallelism).
    feed_src: list[int] = field(default_factory=list)


class ModelRunner:
    """Holds the weights and the KV pool (of one rank); ``execute`` runs one step.

    ``kv_pool`` is the pool's storage (head-major, contiguous: what transports register);
    ``kv_cache`` is the kernels' view of it (``engine.kv_pool``)."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_len: int,
        comm: TPComm | None = None,
        peers: Peers | None = None,
        draft: ModelConfig | None = None,
        num_blocks: int | None = None,
        graph_rows: int | None = None,
    ) -> None:
        """``draft``: the shape of a draft model built after this runner; this pool leaves
        room in the same memory share (``kv_cache_bytes`` on CPU) for its weights, its CUDA
        graphs and a pool of as many blocks as this one. ``num_blocks``: a pool of exactly that
        many blocks, sized by the caller (a draft's); no memory planning of its own.
        ``graph_rows``: CUDA graphs up to that many rows (default ``max_decode_rows``)."""
        self.config = config
        self.model_config = model_config
        self.comm = comm or TPComm(ModelShard.of(model_config, 1, 0))
        self.peers = peers  # rank 0 of several: the other ranks, sent every step first
        self._turn = threading.RLock()  # one command (and its collectives) at a time
        self.device = resolve_device(config, self.comm.rank)
        self.dtype = resolve_dtype(config, self.device)
        self.kv_dtype = fp8.kv_dtype(config.kv_cache_dtype, self.dtype, self.device)
        quantize = config.quantization == "fp8"
        fp8_head = quantize and config.quantize_lm_head
        if quantize:
            fp8.check_device(self.device, "--quantization fp8")
        on_cuda = self.device.type == "cuda"
        graphed = on_cuda and not config.enforce_eager
        reserve = memory.Reserve()
        if draft is not None:
            draft_sizes = []
            if graphed:
                draft_sizes = graph_batch_sizes(
                    config.cuda_graph_batch_sizes, config.max_draft_rows
                )
            reserve = memory.Reserve.of(
                draft, self.dtype, self.kv_dtype, config.block_size, quantize, draft_sizes,
                config.quantize_lm_head,
            )  # fmt: skip
        shard = self.comm.shard
        planned = num_blocks is None
        if on_cuda:  # for this thread; the threads that run steps call bind_thread()
            torch.cuda.set_device(self.device)
            start = memory.CudaStart.now(self.device)
            size = self.dtype.itemsize
            need = memory.weight_bytes(
                model_config, size, shard, 1 if quantize else None, 1 if fp8_head else None
            )
            if planned:
                need += reserve.weight_bytes + reserve.graph_bytes
                memory.check_weights_fit(start, need, config.gpu_memory_utilization)
        if config.load_format == "dummy":
            weights = dummy_weights(
                model_config, self.device, self.dtype, config.seed, shard, quantize, fp8_head
            )
        else:
            weights = load_weights(
                Path(config.model_dir), model_config, self.device, self.dtype, shard, quantize,
                fp8_head,
            )  # fmt: skip
        choices = config.kernels or kernels.KernelChoices.for_device(
            self.device, self.kv_dtype, model_config.head_dim, config.attention_backend
        )
        self.model = DecoderModel(model_config, weights, max_len, self.comm, choices)
        if (
            on_cuda
            and choices.fold_norms
            and shard.size == 1
            and not config.enable_lora
            and not quantize
            and self.dtype in (torch.bfloat16, torch.float16)
        ):
            self.model.fold()  # the decode step's norms and SiLU in the products (kernels)
        # Before the KV plan, so that on CUDA the slots count as weights.
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(
                model_config, config.max_loras, config.max_lora_rank, self.device, self.dtype,
                shard,
            )  # fmt: skip
        self.sampler = Sampler()
        c = model_config
        self.layout = KVLayout(
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            block_size=config.block_size,
            dtype=str(self.kv_dtype).removeprefix("torch."),
            element_size=self.kv_dtype.itemsize,  # 1 for an FP8 cache: half of bf16's bytes
            tp=self.comm.size,
        )
        sizes: list[int] = []
        if graphed:
            rows = config.max_decode_rows if graph_rows is None else graph_rows
            sizes = graph_batch_sizes(config.cuda_graph_batch_sizes, rows)
        mixed_sizes = mixed_graph_sizes(
            config.mixed_graph_sizes, config.mixed_graph_max_tokens, config.max_num_batched_tokens
        ) if graphed else []  # fmt: skip
        plan_bytes = self.block_bytes + reserve.block_bytes
        if num_blocks is not None:
            self.kv_plan = memory.KVPlan(
                num_blocks, self.block_bytes, num_blocks * self.block_bytes
            )
        elif on_cuda:
            self.kv_plan = memory.plan_for_cuda(
                start, self.model, config, plan_bytes, max_len, sizes,
                reserve.weight_bytes + reserve.graph_bytes, mixed_sizes,
            )  # fmt: skip
        else:
            self.kv_plan = memory.plan_fixed(
                plan_bytes, config.num_kv_blocks, config.kv_cache_bytes,
                DEFAULT_CPU_KV_CACHE_BYTES,
            )  # fmt: skip
        # Every rank must have the same blocks: the smallest rank's pool sets the size.
        self.num_blocks = self.comm.min_int(self.kv_plan.num_blocks, self.device)
        self.kv_plan = dataclasses.replace(self.kv_plan, num_blocks=self.num_blocks)
        self.kv_pool = kv_pool.allocate(
            self.layout, self.comm.rank, self.num_blocks, self.kv_dtype, self.device
        )
        self.kv_cache = kv_pool.kernel_view(self.kv_pool)
        # The host tier's blocks (engine.host_store): the target model's pool only.
        slots = 0
        if planned:
            pool_bytes = self.num_blocks * self.layout.block_bytes
            slots = host_slots(config.kv_host_cache_gib, self.layout.block_bytes, self.device,
                               pool_bytes)  # fmt: skip
            slots = self.comm.min_int(slots, self.device)
        self.host_store = HostStore(self.kv_pool, slots) if slots else None
        if config.kv_disk_cache_dir and planned:
            self._open_disk_tier(config.kv_disk_cache_dir, config.kv_disk_cache_gib)
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None
        self._checksums: dict[str, BlockChecksums] = {}  # by algorithm
        self._seals: SealedSums | None = None  # sums kept when blocks are sealed
        if on_cuda:  # compile the checksum kernel now, not in the first hand-off's path
            with contextlib.suppress(ValueError):  # a pool it cannot sum says so when asked
                self._function(self.checksum_algorithm).on_device(
                    torch.zeros(1, dtype=torch.int64, device=self.device)
                )
        if sizes or mixed_sizes:
            before = torch.cuda.memory_reserved(self.device)
            bs = config.block_size
            if sizes:
                # (not under TP: ranks of uneven head shards would capture different sizes twice)
                spread = None
                if config.decode_spread_graphs and self.comm.size == 1:
                    spread = SpreadGraphs()
                self.graphs = DecodeGraphs(
                    self.model, self.kv_cache, sizes, -(-max_len // bs), bs, self.lora,
                    spread=spread,
                )  # fmt: skip
                self.graphs.capture()
            if mixed_sizes:  # every rank the same buckets in the same order (their sums meet)
                self.mixed = MixedGraphs(self.model, self.kv_cache, mixed_sizes)
                self.mixed.capture()
            memory.check_graphs(self.kv_plan, torch.cuda.memory_reserved(self.device) - before)
        log.info("%s", self.kv_plan.describe())
        # Set by ``engine.warmup.warm_up``, which the runner's builder runs next: every kernel
        # variant compiled before serving.
        self.warmup: WarmupReport | None = None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this rank's pool (its KV heads; all of them at TP=1)."""
        return self.layout.shard_block_bytes(self.comm.rank)

    @property
    def sampler_width(self) -> int:
        """Columns of the logits the sampler sees (rows of the LM head, of every rank's
        shard under tensor parallelism)."""
        return (
            sum(self.comm.shard.vocab_rows)
            if self.comm.size > 1
            else int(self.model.w.lm_head.shape[0])
        )

    def bind_thread(self) -> None:
        """Make this engine's device the calling thread's current one (CUDA's current device
        is per thread, and kernels launch on it)."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    def execute(
        self,
        sched: SchedulerOutput,
        grammar: GrammarRuntime | None = None,
        fed: InflightIds | None = None,
    ) -> StepSample:
        """Copy blocks, run the forward pass on every scheduled token, sample where due; the
        sampled ids stay on the device, their copy to the host is under way.

        One row is sampled per sampling sequence and per fork of it (forks reuse its logits).
        With ``grammar``, the bitmasks of constrained rows are filled while the forward pass
        runs (``engine.structured``). The draft tokens of speculating sequences are verified
        (``engine.spec_decode``): those emit their kept drafts and one more token (read back
        at once). ``fed``: the previous step's sampled ids, for the sequences whose newest
        token is still in flight."""
        self.bind_thread()
        self._tier_step(sched)
        if sched.copies:
            self._command("copy", [c.src for c in sched.copies], [c.dst for c in sched.copies])
        sampling = _sampling(sched)
        due = [(i, seq) for i, s in enumerate(sampling) for seq in (s.seq, *s.forks)]
        rows = [
            SamplingRow(
                seq.params,
                seq.generator,
                seq.prompt_token_ids,
                seq.output_token_ids,
                seq.matcher is not None,
                seq.stop_ids,
            )
            for _, seq in due
        ]
        masks = grammar.start_fill([seq.matcher for _, seq in due]) if grammar else None
        logits = self._logits(sched, fed)
        if logits is None:
            return StepSample(done=VerifyOutput([], [], []))
        bitmask = masks.result(logits.device) if masks is not None else None
        if any(s.draft for s in sampling):
            drafts = [s.draft for s in sampling]
            out = sample_with_drafts(self.sampler, logits, drafts, due, rows, bitmask)
            return StepSample(done=out)
        if len(due) != logits.shape[0]:  # forks: repeat their parent's row
            logits = logits[upload([i for i, _ in due], torch.long, logits.device)]
        return StepSample(self.sampler.sample(logits, rows, bitmask))

    def _logits(self, sched: SchedulerOutput, fed: InflightIds | None) -> torch.Tensor | None:
        """Logits of the sampling rows (None when no row samples this step)."""
        batch = self._decode_batch(sched, fed)
        # Only a step with tokens in flight passes their ids (never under tensor parallelism,
        # whose other ranks receive host data only).
        tokens = (fed.tokens,) if fed is not None else ()
        if batch is not None:
            return self._command("graph", batch, *(tokens if batch.fed else ()))
        plan = self._plan(sched, fed)
        return self._command("forward", plan, *(tokens if plan.feed_src else ()))

    # -- commands: what every rank runs (rank 0 sends each to the others first) ---------------
    def run_plan(self, plan: StepPlan, copies: list[CopyOp]) -> torch.Tensor | None:
        """Copy blocks, then one forward pass over ``plan``: the logits of its sample rows (a
        draft model's step, planned by ``engine.draft_model``)."""
        self.bind_thread()
        if copies:
            self._command("copy", [c.src for c in copies], [c.dst for c in copies])
        return self._command("forward", plan)

    def run_rows(self, batch: DecodeBatch, copies: list[CopyOp]) -> torch.Tensor:
        """Copy blocks, then one decode step of ``batch``'s rows through the CUDA graphs: the
        logits of every row (a draft model's step, ``engine.draft_model``)."""
        self.bind_thread()
        if copies:
            self._command("copy", [c.src for c in copies], [c.dst for c in copies])
        return self._command("graph", batch)

    def _command(self, op: str, *args):
        with self._turn:
            if self.peers is None:
                return self._ops()[op](*args)
            self.peers.send(op, args)
            try:
                return self._ops()[op](*args)
            except Exception:
                self.peers.step_failed()  # a dead rank ends the process (RANK_DIED) here
                raise

    def add_lora(self, name: str, path: str) -> LoRASpec:
        """Check and read an adapter here (InvalidAdapterError says why not), then have every
        other rank read its part, in order with the steps (so all make the same slot choices)."""
        assert self.lora is not None
        with self._turn:
            spec = self.lora.add(name, path)
            if self.peers is not None:
                self.peers.send("lora_add", (name, path))
            return spec

    def remove_lora(self, name: str) -> None:
        """Forget an adapter on every rank (no running sequence uses it any more)."""
        assert self.lora is not None
        self._command("lora_remove", name)

    def _lora_add(self, name: str, path: str) -> None:
        """Another rank's part of ``add_lora`` (rank 0 checked the folder already)."""
        assert self.lora is not None
        self.lora.add(name, path)

    def _lora_remove(self, name: str) -> None:
        assert self.lora is not None
        self.lora.remove(name)

    def follow(self, op: str, args: tuple) -> None:
        """Run a command rank 0 sent (ranks 1..N-1)."""
        self.bind_thread()
        self._ops()[op](*args)

    def _ops(self) -> dict:
        return {
            "copy": self._copy,
            "forward": self._forward,
            "graph": self._graph,
            "lora_add": self._lora_add,
            "lora_remove": self._lora_remove,
            "read": self._read,
            "checksum": self._checksum,
            "seal": self._seal,
            "sealed": self._read_sealed,
            "write": self._write,
            "score": self._score,
            "tier": self._tier,
            "settle": self._settle,
        }

    def _open_disk_tier(self, directory: str, gib: float | None) -> None:
        """The disk tier below the host tier (``engine.disk_store``): one file per rank."""
        if self.host_store is None:
            raise ValueError("--kv-disk-cache-dir needs a host KV tier (--kv-host-cache-gib)")
        slots = self.comm.min_int(disk_slots(gib, self.layout.block_bytes, directory), self.device)
        if slots:
            store = self.host_store
            store.disk = DiskStore(directory, self.comm.rank, slots, store.host, self.kv_pool)

    def close_tiers(self) -> None:
        """Stop the disk tier's writer and remove its file (the tiers are unusable after)."""
        if self.host_store is not None and self.host_store.disk is not None:
            self.host_store.disk.close()

    def _tier(self, *args) -> None:
        assert self.host_store is not None
        self.host_store.copy(*args)

    def _tier_step(self, sched: SchedulerOutput) -> None:
        """Before a step: the host tier's copies, and no write under a page-out in flight."""
        if self.host_store is not None:
            t, written = sched.tier, written_blocks(sched, self.config.block_size)
            self._command("tier", *t.args(written))

    def run_tier(self, copies: TierCopies) -> None:
        """Issue host-tier copies now, outside a step (a hand-off's page-ins)."""
        if self.host_store is not None and copies:
            self.bind_thread()
            self._command("tier", *copies.args([]))

    def _settle(self, block_ids: list[int]) -> None:
        assert self.host_store is not None
        self.host_store.settle(block_ids)

    def settle_host(self, block_ids: list[int]) -> None:
        """Wait until no host-tier page-out reads ``block_ids`` (before KV is written into them
        from off the engine's stream: ``HostStore.settle``)."""
        if self.host_store is not None:
            self._command("settle", list(block_ids))

    def _copy(self, src: list[int], dst: list[int]) -> None:
        s, d = upload_many([src, dst], self.device)
        kernels.copy_blocks(self.kv_pool, s, d)

    def _forward(self, plan: StepPlan, fed: torch.Tensor | None = None) -> torch.Tensor | None:
        input_ids, positions, meta, sample_idx = self._tensors(plan, fed)
        lora = self._lora_batch(plan)
        mixed = self.mixed
        if lora is None and mixed is not None and mixed.padded_size(len(plan.token_ids)):
            # The plan alone decides, so every tensor-parallel rank takes the same path.
            hidden = mixed.run(input_ids, positions, meta)
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_cache, meta, lora)
        if not plan.sample_rows:
            return None
        if plan.hidden:
            return hidden[sample_idx]
        return self.model.logits(hidden[sample_idx])

    def release_graphs(self) -> None:
        """Drop the decode and mixed CUDA graphs (the engine is closing; steps after this run
        eagerly): before a tensor-parallel rank leaves its process group
        (`DecodeGraphs.release`)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.mixed is not None:
            self.mixed.release()
            self.mixed = None

    def _graph(self, batch: DecodeBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        """Replay a decode graph; with adapters, each rank first places them in its slots
        (the same choices on every rank) and the LoRA variant reads each row's slot."""
        assert self.graphs is not None
        token_slots = None
        if batch.loras:
            assert self.lora is not None
            token_slots = self.lora.token_slots(batch.token_loras, batch.loras)
        return self.graphs.run(batch, token_slots, fed)

    def _decode_batch(
        self, sched: SchedulerOutput, fed: InflightIds | None = None
    ) -> DecodeBatch | None:
        """The step as a captured graph's input, when every scheduled sequence samples from its
        newest token: that token and the draft after it (a verify step) are a row each
        (``engine.cuda_graphs``), and the graph's logits have a row per row, as ``_plan``'s
        sample rows. Steps with adapters take the graphs' LoRA variant (any mix of at most
        ``max_loras`` adapters and base rows)."""
        graphs = self.graphs
        scheduled = sched.scheduled
        if graphs is None or (sched.loras and graphs.lora is None):
            return None
        if not all(s.samples and s.num_new == 1 + len(s.draft) for s in scheduled):
            return None
        if graphs.padded_size(sched.num_tokens) is None:
            return None
        bs = self.config.block_size
        batch = DecodeBatch(loras=sorted(sched.loras))
        for s in scheduled:
            p = s.seq.num_computed
            ids, src = step_inputs(s.seq, p, p + 1, fed)
            batch.add([*ids, *s.draft], p, s.block_ids, bs, s.seq.lora or "", src[0])
        return batch

    @property
    def checksum_algorithm(self) -> str:
        """The block checksum this pool sends (``engine.kv_checksum``)."""
        return default_algorithm(self.device)

    def block_checksums(self, block_ids: list[int], algorithm: str | None = None) -> list[int]:
        """Checksums of whole canonical blocks (``engine.kv_checksum``), computed on the
        pool's device by ``algorithm`` (None: ``checksum_algorithm``); under tensor
        parallelism each rank sums its heads and rank 0 adds the parts up."""
        algorithm = algorithm or self.checksum_algorithm
        if algorithm not in ALGORITHMS or (algorithm == CRC32 and self.comm.size > 1):
            raise ValueError(f"KV checksum {algorithm!r} is not computed by this worker")
        if not block_ids:
            return []
        self.bind_thread()
        return self._command("checksum", list(block_ids), algorithm)

    def seal_checksums(self, block_ids: list[int]) -> None:
        """Checksum sealed blocks and keep the sums on the pool's device (every rank its part);
        ``handoff_checksums`` reads them."""
        self.bind_thread()
        self._command("seal", list(block_ids))

    def handoff_checksums(self, block_ids: list[int], sealed: list[bool]) -> list[int]:
        """The pool's own checksums of whole blocks: kept ones where ``sealed``, the rest
        computed now (``engine.kv_checksum.SealedSums``)."""
        if not block_ids:
            return []
        self.bind_thread()
        return self._command("sealed", list(block_ids), list(sealed))

    def _function(self, algorithm: str) -> BlockChecksums:
        fn = self._checksums.get(algorithm)
        if fn is None:
            rank = self.comm.rank
            lo, _ = self.layout.heads(rank)
            fn = BlockChecksums(self.kv_pool, algorithm, lo, self.layout.first_holder(rank))
            self._checksums[algorithm] = fn
        return fn

    def _sealed_sums(self) -> SealedSums:
        if self._seals is None:
            self._seals = SealedSums(self._function(self.checksum_algorithm), self.num_blocks)
        return self._seals

    def _seal(self, block_ids: list[int]) -> None:
        self._sealed_sums().seal(block_ids)

    def _read_sealed(self, block_ids: list[int], sealed: list[bool]) -> list[int]:
        return self._combined(self._sealed_sums().read(block_ids, sealed))

    def _checksum(self, block_ids: list[int], algorithm: str) -> list[int]:
        return self._combined(self._function(algorithm)(block_ids))

    def _combined(self, mine: list[int]) -> list[int]:
        """Rank 0: every rank's parts added up (``engine.kv_checksum.combine``)."""
        if self.comm.size == 1:
            return mine
        parts = self.comm.gather_to_first(mine)
        return [] if parts is None else combine(parts)  # type: ignore[arg-type]

    # -- block bytes (the gRPC block stream): canonical blocks, every KV head ------------------
    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Canonical bytes (``libkv.kv_layout``) of whole blocks, from every rank's heads."""
        if not block_ids:
            return []
        self.bind_thread()
        return self._command("read", list(block_ids))

    def _read(self, block_ids: list[int]) -> list[bytes]:
        mine = kv_pool.read_bytes(self.kv_pool, block_ids)
        if self.comm.size == 1:
            return mine
        shards = self.comm.gather_to_first(mine)
        return [] if shards is None else kv_pool.assemble(self.layout, shards)  # type: ignore[arg-type]

    def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None:
        """Write canonical blocks; each rank keeps its heads."""
        for raw in data:
            if len(raw) != self.layout.block_bytes:
                raise ValueError(f"block of {len(raw)} bytes, expected {self.layout.block_bytes}")
        self.bind_thread()
        self._command("write", list(block_ids), list(data))

    def _write(self, block_ids: list[int], data: list[bytes]) -> None:
        if self.host_store is not None:
            self.host_store.guard(block_ids)
        if self.comm.size > 1:
            data = [kv_pool.rank_part(self.layout, self.comm.rank, d) for d in data]
        kv_pool.write_bytes(self.kv_pool, block_ids, data)

    def hidden_all(self, sched: SchedulerOutput) -> torch.Tensor:
        """Final (normed) hidden states of every scheduled token; for embeddings."""
        return self._all_rows(sched, hidden=True)

    def logits_all(self, sched: SchedulerOutput) -> torch.Tensor:
        """Logits of every scheduled token (not just the sampled ones); for scoring."""
        return self._all_rows(sched, hidden=False)

    def _all_rows(self, sched: SchedulerOutput, hidden: bool) -> torch.Tensor:
        self._tier_step(sched)
        plan = self._plan(sched)
        plan.sample_rows = list(range(len(plan.token_ids)))
        plan.hidden = hidden
        out = self._command("forward", plan)
        assert out is not None
        return out

    def prompt_logprobs(
        self, sched: SchedulerOutput, k: int, targets: list[int]
    ) -> list[TokenLogprob]:
        """Raw-model logprob and rank of ``targets[i]`` given the scheduled tokens up to row
        ``i`` (the prompt's next tokens: one fewer than the rows in the prompt's last chunk), with
        the ``k`` most likely tokens at that place (a prompt alone, ``engine.pooling``)."""
        self._tier_step(sched)
        plan = self._plan(sched)
        plan.sample_rows = list(range(len(plan.token_ids)))
        plan.hidden = True
        chosen, ranks, top_lp, top_ids = self._command("score", plan, k, targets)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(top_ids, top_lp, strict=True)]
        return [
            TokenLogprob(t, lp, top, rank)
            for t, lp, rank, top in zip(targets, chosen, ranks, tops, strict=True)
        ]

    def _score(self, plan: StepPlan, k: int, target_ids: list[int]) -> tuple[list, ...]:
        """``prompt_logprobs``' forward pass (every rank: the LM head gathers the vocabulary),
        the LM head and softmax taken ``SCORE_ELEMENTS`` logits at a time."""
        hidden = self._forward(plan)
        assert hidden is not None
        targets = torch.tensor(target_ids, dtype=torch.long, device=self.device)
        n = len(targets)
        step = max(1, SCORE_ELEMENTS // max(self.sampler_width, 1))
        parts: list[tuple[torch.Tensor, ...]] = []
        for lo in range(0, n, step):
            lp = torch.log_softmax(self.model.logits(hidden[lo : min(n, lo + step)]), dim=-1)
            t = targets[lo : lo + lp.shape[0], None]
            chosen = lp.gather(1, t)
            rank = (lp > chosen).sum(1) + 1
            top_lp, top_ids = lp.topk(min(k, lp.shape[1]), dim=-1)
            parts.append((chosen.squeeze(1), rank, top_lp, top_ids))
        if not parts:
            return [], [], [], []
        chosen, rank, top_lp, top_ids = (torch.cat(x).cpu() for x in zip(*parts, strict=True))
        return chosen.tolist(), rank.tolist(), top_lp.tolist(), top_ids.tolist()

    def _lora_batch(self, plan: StepPlan) -> LoRABatch | None:
        """Place the step's adapters in slots; None when no token of the step has one."""
        if self.lora is None or not plan.loras:
            return None
        return self.lora.batch(plan.token_loras, self.lora.prepare(set(plan.loras)))

    def _plan(self, sched: SchedulerOutput, fed: InflightIds | None = None) -> StepPlan:
        bs = self.config.block_size
        ids: list[int] = []
        feed: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for s in sched.scheduled:
            seq, lo = s.seq, s.seq.num_computed
            hi = lo + s.num_new
            table = s.block_ids
            known, src = step_inputs(seq, lo, hi - len(s.draft), fed)
            ids.extend(known)
            ids.extend(s.draft)
            feed.extend(src)
            feed.extend([-1] * len(s.draft))
            pos.extend(range(lo, hi))
            slots.extend(table[p // bs] * bs + p % bs for p in range(lo, hi))
            starts.append(starts[-1] + s.num_new)
            seq_lens.append(hi)
            tables.append(table)
            if s.samples:  # the newest token's row, and one row per draft token after it
                sample_rows.extend(range(starts[-1] - 1 - len(s.draft), starts[-1]))
        max_q = max(s.num_new for s in sched.scheduled)
        plan = StepPlan(ids, pos, slots, starts, seq_lens, tables, max_q, sample_rows)
        if any(f >= 0 for f in feed):
            plan.feed_src = feed
        if sched.loras:
            plan.loras = sorted(sched.loras)
            plan.token_loras = [s.seq.lora for s in sched.scheduled for _ in range(s.num_new)]
        return plan

    def _tensors(self, plan: StepPlan, fed: torch.Tensor | None = None):
        """Input ids, positions, attention metadata and sample-row indices of ``plan`` on the
        device, in one non-blocking copy; ids in flight gathered from ``fed``."""
        bs = self.config.block_size
        width = max(len(t) for t in plan.block_tables)
        tables = [b for t in plan.block_tables for b in (*t, *[0] * (width - len(t)))]
        parts = [plan.token_ids, plan.positions, plan.slots, plan.seq_lens, plan.query_start]
        parts += [tables, plan.sample_rows, plan.feed_src]
        ids, pos, slot_t, seq_lens, starts, table_t, sample_idx, src = upload_many(
            parts, self.device
        )
        if plan.feed_src:
            assert fed is not None, "tokens in flight and no sampled ids to take them from"
            feed_ids(ids, src, fed)
        meta = kernels.AttentionMetadata(
            slot_blocks=slot_t // bs,
            slot_offsets=slot_t % bs,
            block_tables=table_t.view(-1, width),
            seq_lens=seq_lens,
            query_start_loc=starts,
            max_query_len=plan.max_query_len,
            max_seq_len=max(plan.seq_lens),
            block_size=bs,
        )
        return ids, pos, meta, sample_idx


def _sampling(sched: SchedulerOutput) -> list[ScheduledSeq]:
    return [s for s in sched.scheduled if s.samples]
