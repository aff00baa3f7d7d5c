"""Cases of the skinny decode products (``kernels.triton_skinny``) against the references,
shared by the GPU tests and the CPU interpreter check (``TRITON_INTERPRET=1``); each returns
``(name, relative error)`` rows or raises on a hard mismatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernels import reference
from kernels.triton_skinny import SkinnyPlan, linear, linear_sums, rms_linear


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def small_plans(dot_ok: bool = True) -> list[SkinnyPlan]:
    """Plans that cover every path on small shapes: CUDA cores with one or more rows, tensor
    cores, split-K (also uneven), weight rows and K not multiples of the tile."""
    plans = [
        SkinnyPlan(block_n=8, block_k=32),
        SkinnyPlan(block_n=8, block_k=32, prefetch=False),
        SkinnyPlan(block_n=4, block_k=256, num_warps=1),  # one row of x for the tile (XR = 1)
        SkinnyPlan(block_n=4, block_k=16, split_k=3),
        SkinnyPlan(block_n=16, block_k=64, split_k=2),
    ]
    if dot_ok:
        plans += [SkinnyPlan(block_n=16, block_k=32, dot=True),
                  SkinnyPlan(block_n=16, block_k=32, dot=True, split_k=2)]  # fmt: skip
    return plans


def product_cases(device: str, dtype: torch.dtype, plans: list[SkinnyPlan],
                  shapes: tuple[tuple[int, int], ...] = ((40, 96), (64, 128)),
                  rows: tuple[int, ...] = (1, 3, 8)) -> list[tuple[str, float]]:  # fmt: skip
    """Plain products, bf16/fp16 and FP8 weights, with and without bias."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in shapes:
        for m in rows:
            x = torch.randn(m, k, generator=g).to(device, dtype)
            w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
            bias = torch.randn(n, generator=g).to(device, dtype)
            fw = reference.quantize_fp8_rows(w)
            for plan in plans:
                for fp8 in (False, True):
                    wt, sc = (fw.weight, fw.scale) if fp8 else (w, None)
                    want = reference.linear(x.float(), fw if fp8 else w.float(), bias.float())
                    got = linear(x, wt, bias, sc, plan)
                    name = f"{'fp8' if fp8 else 'w16'}_n{n}_k{k}_m{m}_{plan.label()}"
                    out.append((name, rel_err(got, want)))
    return out


def fold_sums_cases(device: str, dtype: torch.dtype, plans: list[SkinnyPlan],
                    rows: tuple[int, ...] = (1, 3, 8),
                    n: int = 96, k: int = 128) -> list[tuple[str, float]]:  # fmt: skip
    """The folded norm's sums of squares made by the product before it: ``linear_sums`` (the
    residual added in the epilogue; its sums must add up to the rows' squares) feeding
    ``rms_linear(sums=)`` with and without the SiLU epilogue, every pair of ``plans``, against
    the references."""
    g = torch.Generator().manual_seed(2)
    out = []
    for m in rows:
        a = torch.randn(m, k, generator=g).to(device, dtype)
        w1 = (torch.randn(k, k, generator=g) * 0.05).to(device, dtype)
        add = torch.randn(m, k, generator=g).to(device, dtype)
        w2 = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
        for p1 in plans:
            s, sums = linear_sums(a, w1, add, p1)
            tag = f"m{m}_{p1.label()}"
            want = a.float() @ w1.float().T + add.float()
            out.append((f"sums_add_{tag}", rel_err(s, want)))
            if sums.shape[0] != -(-k // p1.block_n):
                raise AssertionError(f"sums_{tag}: {list(sums.shape)} for {k} columns")
            total = sums[:, :m].sum(0)
            out.append((f"sums_total_{tag}", rel_err(total, (s.float() ** 2).sum(1))))
            h, _ = reference.rms_norm(s.float(), torch.ones(k, device=device), 1e-5)
            for p2 in plans:
                if p2.split_k > 1:
                    continue
                got = rms_linear(s, 1e-5, w2, None, None, p2, sums=sums)
                out.append((f"sums_rms_{tag}_{p2.label()}", rel_err(got, h @ w2.float().T)))
                if (n // 2) % max(p2.block_n // 2, 1) == 0 and p2.block_n >= 2:
                    got = rms_linear(s, 1e-5, w2, None, None, p2, silu=True, sums=sums)
                    act = reference.silu_and_mul(h @ w2.float().T)
                    out.append((f"sums_silu_{tag}_{p2.label()}", rel_err(got, act)))
    return out


def interpreted_json(script: str) -> object:
    """Run ``script`` under Triton's interpreter and return the JSON it prints last; skips the
    test where numpy is too new for Triton 3.6's interpreter (it indexes 1-element arrays as
    scalars, which numpy 2.3 refused)."""
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip("Triton 3.6's interpreter needs numpy < 2.3")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compiled_rows(script: str) -> list[dict]:
    """Run ``script`` (it compiles kernels for sm_90 off the GPU and prints a JSON list last)
    without the interpreter; skips the test where this Triton install has no ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    if proc.returncode and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas in this Triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
