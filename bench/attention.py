"""Attention at long context on one GPU: Tandem's Triton kernels against FlashAttention 3
(`kernels.flash_attn`) on the same paged pools, per shape.

Shapes are the Llama-3.1-8B heads (32 query heads, 8 KV heads, 128 dims, 16-token blocks,
blocks scattered at random through a two-layer block-major pool):

- ``prefill``: one 2,048-token chunk over a cached prefix of 0-32k tokens (chunked prefill);
- ``decode``: batches of 1-64 single-token queries at 8k-32k tokens of context;
- ``mixed``: one 2,048-token chunk and 63 decodes at the same context, in one call (what a
  step of chunked prefill with decodes attends), which Triton serves with its prefill kernel;
- ``--served``: instead, decode batches of 16-64 at the contexts a 4,096-token server decodes
  (1k and 2k each, and lengths drawn from 128-2,560: the mixed serving workload's spread), and
  of 32 and 64 at 8k and drawn from 800-15,500 (a long-prompt trace's).

Each case is checked first (the two kernels' outputs against each other, and against the
PyTorch reference where it fits in memory), then timed as CUDA-graph replays (no launch
overhead in the figure). Writes ``attention.json`` and ``attention.md`` under ``--out``.

    python -m bench.attention --out DIR [--quick | --served]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu_common import graph_time_ms
from kernels import flash_attn
from kernels.reference import FP8
from tests.kernel_cases import make_paged_batch, reference_attention, rel_err

HEADS = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
SCALE = 128**-0.5
CHUNK = 2048


def cases(quick: bool) -> list[tuple[str, list[int], list[int]]]:
    """``(name, seq_lens, q_lens)`` of every case."""
    ctxs = [8192] if quick else [8192, 16384, 32768]
    out = []
    for prefix in [0, *ctxs]:
        out.append((f"prefill chunk {CHUNK} over {prefix}", [prefix + CHUNK], [CHUNK]))
    for ctx in ctxs:
        for b in [1, 16] if quick else [1, 16, 64]:
            out.append((f"decode b={b} ctx={ctx}", [ctx] * b, [1] * b))
    for ctx in ctxs:
        out.append((f"mixed chunk {CHUNK} + 63 decodes ctx={ctx}", [ctx + CHUNK] + [ctx] * 63,
                    [CHUNK] + [1] * 63))  # fmt: skip
    return out


def served_cases() -> list[tuple[str, list[int], list[int]]]:
    """Decode batches at a 4,096-token server's contexts: uniform 1k and 2k, and spread."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for b in [16, 32, 48, 64]:
        for ctx in [1024, 2048]:
            out.append((f"decode b={b} ctx={ctx}", [ctx] * b, [1] * b))
        lens = torch.randint(128, 2561, (b,), generator=gen).tolist()
        out.append((f"decode b={b} ctx=128-2560 (mean {sum(lens) // b})", lens, [1] * b))
    for b in [32, 64]:
        out.append((f"decode b={b} ctx=8192", [8192] * b, [1] * b))
        lens = torch.randint(800, 15501, (b,), generator=gen).tolist()
        out.append((f"decode b={b} ctx=800-15500 (mean {sum(lens) // b})", lens, [1] * b))
    return out


def triton_call(q, kv, meta, k_scale: float = 1.0) -> Callable[[], torch.Tensor]:
    from kernels.triton_decode import decode_attention
    from kernels.triton_prefill import prefill_attention

    if meta.max_query_len == 1:
        return lambda: decode_attention(
            q, kv, 1, meta.block_tables, meta.seq_lens, SCALE, k_scale=k_scale, v_scale=k_scale
        )
    return lambda: prefill_attention(
        q, kv, 1, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
        SCALE, k_scale=k_scale, v_scale=k_scale,
    )  # fmt: skip


def fa3_call(q, kv, meta) -> Callable[[], torch.Tensor]:
    return lambda: flash_attn.paged_attention(q, kv, 1, meta, SCALE)


def run_case(name: str, seq_lens: list[int], q_lens: list[int], fp8: bool) -> dict:
    q, kv, meta = make_paged_batch(seq_lens, q_lens, **HEADS, seed=len(seq_lens),
                                   draw_on_device=True)  # fmt: skip
    row: dict = {"case": name, "kv": "fp8" if fp8 else "bf16", "tokens": sum(seq_lens)}
    if fp8:
        kv = (kv.float() * 0.25).to(FP8)  # random values within e4m3's range at scale 4
    tri = triton_call(q, kv, meta, 4.0 if fp8 else 1.0)
    got_t = tri()
    if sum(seq_lens) * max(q_lens) <= 2**24 and not fp8:  # the reference's mask fits
        row["triton_vs_ref"] = rel_err(got_t, reference_attention(q, kv, 1, meta, SCALE))
    row["triton_ms"] = graph_time_ms([tri])
    if not fp8 and flash_attn.unavailable_reason(q.device, kv.dtype, 128) is None:
        fa = fa3_call(q, kv, meta)
        got_f = fa()
        row["fa3_vs_triton"] = rel_err(got_f, got_t)
        if "triton_vs_ref" in row:
            row["fa3_vs_ref"] = rel_err(got_f, reference_attention(q, kv, 1, meta, SCALE))
        row["fa3_ms"] = graph_time_ms([fa])
        row["triton_over_fa3"] = row["triton_ms"] / row["fa3_ms"]
    del q, kv, meta
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    head = "| case | KV | Triton ms | FA3 ms | Triton / FA3 | FA3 vs Triton (rel err) |"
    lines = [head, "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        fa = f"{r['fa3_ms']:.3f}" if "fa3_ms" in r else "-"
        ratio = f"{r['triton_over_fa3']:.2f}x" if "triton_over_fa3" in r else "-"
        err = f"{r['fa3_vs_triton']:.1e}" if "fa3_vs_triton" in r else "-"
        lines.append(f"| {r['case']} | {r['kv']} | {r['triton_ms']:.3f} | {fa} | {ratio} | {err} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="8k context only (a dry run)")
    ap.add_argument("--served", action="store_true", help="decode at 1-2.5k context only")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    info = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "fa3": flash_attn.unavailable_reason(dev, torch.bfloat16, 128) or "available",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(info, flush=True)
    rows = []
    if args.served:
        all_cases = [(c, False) for c in served_cases()]
    else:
        all_cases = [(c, False) for c in cases(args.quick)]
        all_cases += [(c, True) for c in cases(True) if "b=1 " not in c[0]]
    for (name, seq_lens, q_lens), fp8 in all_cases:
        try:
            rows.append(run_case(name, seq_lens, q_lens, fp8))
        except Exception as e:  # a case that fails is recorded, the others still run
            rows.append({"case": name, "kv": "fp8" if fp8 else "bf16", "error": repr(e)[:300]})
            torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    ok = [r for r in rows if "error" not in r]
    md = table(ok)
    errors = [f"- {r['case']} ({r['kv']}): {r['error']}" for r in rows if "error" in r]
    (args.out / "attention.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    (args.out / "attention.md").write_text(md + "\n" + "\n".join(errors) + "\n")
    print(md, *errors, sep="\n")


if __name__ == "__main__":
    main()
