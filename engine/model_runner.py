"""Turns a scheduler step into tensors, runs the model and samples: the only torch user of the
engine's step loop."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import kernels
from engine import memory
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeBatch, DecodeGraphs, graph_batch_sizes
from engine.loader import dummy_weights, load_weights
from engine.model import DecoderModel
from engine.sampler import Sampler, SamplerOutput, SamplingRow
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.structured import GrammarRuntime

log = logging.getLogger(__name__)


def resolve_device(config: EngineConfig) -> torch.device:
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


class ModelRunner:
    """Holds the weights and the KV pool; ``execute`` runs one step."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        on_cuda = self.device.type == "cuda"
        if on_cuda:  # for this thread; the threads that run steps call bind_thread()
            torch.cuda.set_device(self.device)
            start = memory.CudaStart.now(self.device)
            size = torch.finfo(self.dtype).bits // 8
            need = memory.weight_bytes(model_config, size)
            memory.check_weights_fit(start, need, config.gpu_memory_utilization)
        if config.load_format == "dummy":
            weights = dummy_weights(model_config, self.device, self.dtype, config.seed)
        else:
            weights = load_weights(Path(config.model_dir), model_config, self.device, self.dtype)
        self.model = DecoderModel(model_config, weights, max_len)
        self.sampler = Sampler()
        sizes: list[int] = []
        if on_cuda and not config.enforce_eager:
            sizes = graph_batch_sizes(config.cuda_graph_batch_sizes, config.max_num_seqs)
        if on_cuda:
            self.kv_plan = memory.plan_for_cuda(
                start, self.model, config, self.block_bytes, max_len, sizes
            )
        else:
            self.kv_plan = memory.plan_fixed(
                self.block_bytes, config.num_kv_blocks, config.kv_cache_bytes,
                DEFAULT_CPU_KV_CACHE_BYTES,
            )  # fmt: skip
        self.num_blocks = self.kv_plan.num_blocks
        c = model_config
        self.kv_cache = torch.zeros(
            (self.num_blocks, c.num_layers, 2, config.block_size, c.num_kv_heads, c.head_dim),
            device=self.device,
            dtype=self.dtype,
        )
        self.graphs: DecodeGraphs | None = None
        if sizes:
            before = torch.cuda.memory_reserved(self.device)
            bs = config.block_size
            self.graphs = DecodeGraphs(self.model, self.kv_cache, sizes, -(-max_len // bs), bs)
            self.graphs.capture()
            memory.check_graphs(self.kv_plan, torch.cuda.memory_reserved(self.device) - before)
        log.info("%s", self.kv_plan.describe())

    @property
    def block_bytes(self) -> int:
        c = self.model_config
        elem = torch.finfo(self.dtype).bits // 8
        return c.num_layers * 2 * self.config.block_size * c.num_kv_heads * c.head_dim * elem

    def bind_thread(self) -> None:
        """Make this engine's device the calling thread's current one (CUDA's current device
        is per thread, and kernels launch on it)."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    def execute(
        self, sched: SchedulerOutput, grammar: GrammarRuntime | None = None
    ) -> SamplerOutput:
        """Copy blocks, run the forward pass on every scheduled token, sample where due.

        One row is sampled per sampling sequence and per fork of it (forks reuse its logits).
        With ``grammar``, the bitmasks of constrained rows are filled while the forward pass
        runs (``engine.structured``)."""
        self.bind_thread()
        if sched.copies:
            src = torch.tensor([c.src for c in sched.copies], device=self.device)
            dst = torch.tensor([c.dst for c in sched.copies], device=self.device)
            kernels.copy_blocks(self.kv_cache, src, dst)
        due = [(i, seq) for i, s in enumerate(_sampling(sched)) for seq in (s.seq, *s.forks)]
        rows = [
            SamplingRow(
                seq.params,
                seq.generator,
                seq.prompt_token_ids,
                seq.output_token_ids,
                seq.matcher is not None,
            )
            for _, seq in due
        ]
        masks = grammar.start_fill([seq.matcher for _, seq in due]) if grammar else None
        logits = self._logits(sched)
        if logits is None:
            return SamplerOutput([], [])
        if len(due) != logits.shape[0]:  # forks: repeat their parent's row
            logits = logits[torch.tensor([i for i, _ in due], device=logits.device)]
        bitmask = masks.result(logits.device) if masks is not None else None
        return self.sampler(logits, rows, bitmask)

    def _logits(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Logits of the sampling rows (None when no row samples this step)."""
        logits = self._decode_graph_logits(sched)
        if logits is not None:
            return logits
        input_ids, positions, meta, sample_rows = self._prepare(sched)
        if not sample_rows:
            self.model.forward(input_ids, positions, self.kv_cache, meta)
            return None
        # Made before the forward pass, so that on CUDA building it waits for no kernel.
        sample_idx = torch.tensor(sample_rows, device=self.device)
        hidden = self.model.forward(input_ids, positions, self.kv_cache, meta)
        return self.model.logits(hidden[sample_idx])

    def _decode_graph_logits(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Logits from a captured graph when the step is pure decode and fits one; else None."""
        graphs = self.graphs
        scheduled = sched.scheduled
        if graphs is None or graphs.padded_size(len(scheduled)) is None:
            return None
        if not all(s.num_new == 1 and s.samples for s in scheduled):
            return None
        bs = self.config.block_size
        positions = [s.seq.num_computed for s in scheduled]
        blocks = [s.block_ids[p // bs] for s, p in zip(scheduled, positions, strict=True)]
        batch = DecodeBatch(
            token_ids=[_token_at(s.seq, p) for s, p in zip(scheduled, positions, strict=True)],
            positions=positions,
            slot_blocks=blocks,
            slot_offsets=[p % bs for p in positions],
            block_tables=[s.block_ids for s in scheduled],
            seq_lens=[p + 1 for p in positions],
        )
        return graphs.run(batch)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        if not block_ids:
            return []
        self.bind_thread()
        idx = torch.tensor(block_ids, device=self.device)
        blocks = self.kv_cache[idx].cpu()
        return [_tensor_bytes(b) for b in blocks]

    def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None:
        shape = self.kv_cache.shape[1:]
        self.bind_thread()
        for block_id, raw in zip(block_ids, data, strict=True):
            if len(raw) != self.block_bytes:
                raise ValueError(f"block of {len(raw)} bytes, expected {self.block_bytes}")
            src = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            self.kv_cache[block_id].copy_(src.view(self.dtype).view(shape))

    def logits_all(self, sched: SchedulerOutput) -> torch.Tensor:
        """Logits of every scheduled token (not just the sampled ones); for scoring."""
        input_ids, positions, meta, _ = self._prepare(sched)
        return self.model.logits(self.model.forward(input_ids, positions, self.kv_cache, meta))

    def _prepare(self, sched: SchedulerOutput):
        bs = self.config.block_size
        ids: list[int] = []
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
            ids.extend(seq.all_token_ids[lo:hi])
            pos.extend(range(lo, hi))
            slots.extend(table[p // bs] * bs + p % bs for p in range(lo, hi))
            starts.append(starts[-1] + s.num_new)
            seq_lens.append(hi)
            tables.append(table)
            if s.samples:
                sample_rows.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        slot_t = torch.tensor(slots, device=dev)
        meta = kernels.AttentionMetadata(
            slot_blocks=slot_t // bs,
            slot_offsets=slot_t % bs,
            block_tables=torch.tensor(padded, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            query_start_loc=torch.tensor(starts, device=dev),
            max_query_len=max(s.num_new for s in sched.scheduled),
            max_seq_len=max(seq_lens),
            block_size=bs,
        )
        return torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, sample_rows


def _sampling(sched: SchedulerOutput) -> list[ScheduledSeq]:
    return [s for s in sched.scheduled if s.samples]


def _token_at(seq, pos: int) -> int:
    """Token ``pos`` of a sequence without building its whole token list."""
    n = len(seq.prompt_token_ids)
    return seq.prompt_token_ids[pos] if pos < n else seq.output_token_ids[pos - n]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
