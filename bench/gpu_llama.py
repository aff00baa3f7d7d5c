"""The Llama-3.1-8B shape (random bf16 weights) through the engine's model: decode steps
replayed from the engine's CUDA graphs, and prefill, against the measured ceilings."""

from __future__ import annotations

import statistics
import time

import torch

from bench.gpu_common import Ceilings, time_ms
from engine import kv_pool
from engine.config import ModelConfig
from engine.cuda_graphs import DecodeBatch, DecodeGraphs
from engine.model import DecoderModel, LayerWeights, ModelWeights
from kernels import AttentionMetadata, Fp8Weight
from libkv.kv_layout import KVLayout

BLOCK = 16


def random_weights(c: ModelConfig, seed: int = 0, device: str = "cuda") -> ModelWeights:
    """Random bf16 weights drawn on the GPU (std 0.02, norms near 1)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * 0.02

    def norm() -> torch.Tensor:
        return 1 + rand(c.hidden_size)

    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layers = [
        LayerWeights(
            norm(),
            rand(qkv_rows, c.hidden_size),
            None,
            rand(c.hidden_size, c.num_heads * c.head_dim),
            norm(),
            rand(2 * c.intermediate_size, c.hidden_size),
            rand(c.hidden_size, c.intermediate_size),
        )
        for _ in range(c.num_layers)
    ]
    return ModelWeights(
        rand(c.vocab_size, c.hidden_size), layers, norm(), rand(c.vocab_size, c.hidden_size)
    )


def _nbytes(t: torch.Tensor | Fp8Weight) -> int:
    if isinstance(t, Fp8Weight):  # one byte per weight plus a float32 scale per row
        return t.weight.numel() + t.scale.numel() * 4
    return t.numel() * t.element_size()


def weight_bytes_per_step(w: ModelWeights) -> int:
    """Bytes a decode step must read: every layer weight, the final norm and the LM head."""
    n = sum(
        _nbytes(t)
        for lw in w.layers
        for t in (lw.input_norm, lw.qkv, lw.o_proj, lw.post_norm, lw.gate_up, lw.down)
    )
    return n + _nbytes(w.norm) + _nbytes(w.lm_head)


def kv_bytes_per_token(c: ModelConfig, element_size: int = 2) -> int:
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * element_size


class LlamaBench:
    """One model and one KV pool of ``num_blocks`` random blocks, shared by every config
    (``device`` "cpu": the benchmarks' dry runs, eager steps instead of graph replays)."""

    def __init__(self, c: ModelConfig, num_blocks: int, max_len: int, device: str = "cuda") -> None:
        self.c = c
        self.device = device
        self.w = random_weights(c, device=device)
        self.model = DecoderModel(c, self.w, max_len)
        self.max_len = max_len
        # The engine's pool: head-major storage, read through the kernels' view (engine.kv_pool).
        layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "bfloat16", 2)
        pool = kv_pool.allocate(layout, 0, num_blocks, torch.bfloat16, torch.device(device))
        for i in range(0, num_blocks, 1024):  # random, never zeros
            pool[i : i + 1024].normal_()
        self.kv = kv_pool.kernel_view(pool)
        self.perm = torch.randperm(num_blocks).tolist()

    def tables(self, b: int, tokens: int) -> list[list[int]]:
        nb = -(-tokens // BLOCK)
        return [self.perm[i * nb : (i + 1) * nb] for i in range(b)]

    def decode(self, b: int, ctx: int, ceil: Ceilings) -> dict:
        """One decode step of ``b`` sequences that hold ``ctx`` tokens each (graph replay)."""
        tables = self.tables(b, ctx + 1)
        batch = DecodeBatch(
            token_ids=torch.randint(
                0, self.c.vocab_size, (b,), generator=torch.Generator().manual_seed(b)
            ).tolist(),
            positions=[ctx] * b,
            slot_blocks=[t[ctx // BLOCK] for t in tables],
            slot_offsets=[ctx % BLOCK] * b,
            block_tables=tables,
            seq_lens=[ctx + 1] * b,
        )
        ms, host_ms, self.last_logits = self._time_graph(batch)
        kv_token = kv_bytes_per_token(self.c, self.kv.element_size())
        nbytes = weight_bytes_per_step(self.w) + b * (ctx + 1) * kv_token
        roof_ms = nbytes / ceil.copy_bytes_per_s * 1e3
        return {
            "batch": b,
            "ctx": ctx,
            "step_ms": ms,
            "step_with_host_ms": host_ms,
            "bytes": nbytes,
            "roofline_ms": roof_ms,
            "frac_roofline": roof_ms / ms,
        }

    def _time_graph(self, batch: DecodeBatch) -> tuple[float, float, torch.Tensor]:
        """Median replay time (events), median wall time of the engine's whole path (inputs
        up, replay, argmax, tokens down), and the step's logits (on the host)."""
        b = len(batch.token_ids)
        if self.device != "cuda":
            ids, pos, meta = self._decode_inputs(b, batch.seq_lens[0] - 1)
            ms = time_ms(lambda: self.model.logits(self.model.forward(ids, pos, self.kv, meta)),
                         warmup=1, iters=3)  # fmt: skip
            return ms, ms, self.model.logits(self.model.forward(ids, pos, self.kv, meta)).cpu()
        graphs = DecodeGraphs(self.model, self.kv, [b], -(-self.max_len // BLOCK), BLOCK)
        graphs.capture()
        logits = graphs.run(batch).float().cpu()
        ms = time_ms(lambda: graphs.replay(b), warmup=3, iters=30)
        host = []
        for _ in range(10):
            t0 = time.perf_counter()
            graphs.run(batch).argmax(-1).tolist()
            host.append((time.perf_counter() - t0) * 1e3)
        return ms, statistics.median(host), logits

    def profile_graph(self, b: int, ctx: int, replays: int = 5) -> dict:
        """Where a replayed decode step's GPU time goes: each kernel's time per step (by name,
        summed over the layers), their sum, and the step's span (first start to last end; the
        rest is gaps between kernels)."""
        tables = self.tables(b, ctx + 1)
        batch = DecodeBatch(token_ids=[1] * b, positions=[ctx] * b,
                            slot_blocks=[t[ctx // BLOCK] for t in tables],
                            slot_offsets=[ctx % BLOCK] * b, block_tables=tables,
                            seq_lens=[ctx + 1] * b)  # fmt: skip
        graphs = DecodeGraphs(self.model, self.kv, [b], -(-self.max_len // BLOCK), BLOCK)
        graphs.capture()
        graphs.run(batch)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(replays):
                graphs.replay(b)
                torch.cuda.synchronize()
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if not kern:
            return {"error": "no kernels in the profile"}
        per: dict[str, list[float]] = {}
        for e in kern:
            per.setdefault(e.name[:60], []).append(e.device_time)
        span = max(e.time_range.end for e in kern) - min(e.time_range.start for e in kern)
        rows = sorted(({"kernel": k, "us_per_step": sum(v) / replays, "calls_per_step":
                        len(v) / replays} for k, v in per.items()),
                      key=lambda r: -r["us_per_step"])  # fmt: skip
        total = sum(r["us_per_step"] for r in rows)
        return {
            "batch": b,
            "ctx": ctx,
            "kernels_us": total,
            "span_us_all_replays": span,
            "rows": rows[:14],
        }

    def _prefill_inputs(self, t: int):
        table = self.tables(1, t)[0]
        dev = "cuda"
        pos = torch.arange(t, device=dev)
        tbl = torch.tensor([table], device=dev)
        meta = AttentionMetadata(
            slot_blocks=tbl[0][pos // BLOCK],
            slot_offsets=pos % BLOCK,
            block_tables=tbl,
            seq_lens=torch.tensor([t], device=dev),
            query_start_loc=torch.tensor([0, t], device=dev),
            max_query_len=t,
            max_seq_len=t,
            block_size=BLOCK,
        )
        ids = torch.randint(0, self.c.vocab_size, (t,), device=dev)
        return ids, pos, meta

    def prefill(self, t: int, ceil: Ceilings) -> dict:
        """A ``t``-token prompt, no cached prefix: forward plus the last row's logits."""
        ids, pos, meta = self._prefill_inputs(t)

        def step():
            hidden = self.model.forward(ids, pos, self.kv, meta)
            return self.model.logits(hidden[-1:])

        ms = time_ms(step, warmup=2, iters=5)
        c = self.c
        layer_params = sum(
            x.numel()
            for x in (
                self.w.layers[0].qkv,
                self.w.layers[0].o_proj,
                self.w.layers[0].gate_up,
                self.w.layers[0].down,
            )
        )
        flops = 2 * t * layer_params * c.num_layers + 2 * c.hidden_size * c.vocab_size
        flops += 2 * t * t * c.head_dim * c.num_heads * c.num_layers  # causal attention
        return {
            "tokens": t,
            "ms": ms,
            "flops": flops,
            "frac_matmul": flops / ceil.matmul_flops_per_s / (ms / 1e3),
        }

    def _decode_inputs(self, b: int, ctx: int):
        """Token ids, positions and metadata of an eager decode step (``ctx`` tokens held)."""
        tables = self.tables(b, ctx + 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_blocks=torch.tensor([t[ctx // BLOCK] for t in tables], device=dev),
            slot_offsets=torch.full((b,), ctx % BLOCK, device=dev),
            block_tables=torch.tensor(tables, device=dev),
            seq_lens=torch.full((b,), ctx + 1, device=dev),
            query_start_loc=torch.arange(b + 1, device=dev),
            max_query_len=1,
            max_seq_len=ctx + 1,
            block_size=BLOCK,
        )
        ids = torch.zeros(b, dtype=torch.long, device=dev) + 5
        pos = torch.full((b,), ctx, device=dev)
        return ids, pos, meta

    def profile_decode(self, b: int, ctx: int) -> str:
        """Per-kernel GPU time of one eager decode step (where the time goes)."""
        ids, pos, meta = self._decode_inputs(b, ctx)
        if self.device != "cuda":
            return "(no GPU: no profile)"
        for _ in range(2):
            self.model.logits(self.model.forward(ids, pos, self.kv, meta))
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            self.model.logits(self.model.forward(ids, pos, self.kv, meta))
            torch.cuda.synchronize()
        return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
