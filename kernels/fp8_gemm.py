"""FP8 matrix products on the tensor cores (Hopper, Ada): ``x`` quantized per row to e4m3 on
the fly, the weight quantized per output channel at load (``reference.Fp8Weight``), and one
``torch._scaled_mm`` with row-wise scales. Used for more rows than the skinny kernel takes;
its reference is ``reference.linear`` (the dequantized weight; activations stay unquantized
there, so they differ by the activation rounding, about 2**-4 relative per element)."""

from __future__ import annotations

import torch

from kernels.reference import FP8_MAX, Fp8Weight, to_fp8


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x / s) in e4m3, s)`` with one float32 scale per row (``[M, 1]``)."""
    s = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return to_fp8(x.float() / s), s


def scaled_mm_linear(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype for a bf16 or fp16 ``x`` ``[M, K]`` and an FP8 weight
    ``[N, K]`` (K and N multiples of 16, as the FP8 tensor cores need)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2:
        raise ValueError(
            f"scaled_mm_linear takes a 2-d bfloat16 or float16 x, got {x.dtype} {x.dim()}-d"
        )
    n, k = w.weight.shape
    if x.shape[1] != k or k % 16 or n % 16:
        raise ValueError(f"x {list(x.shape)} / w {[n, k]}: K and N must be multiples of 16")
    m = x.shape[0]
    if m % 16:  # rows padded to the tensor cores' tile (zero rows, dropped after)
        x = torch.cat([x, x.new_zeros(16 - m % 16, k)])
    xq, xs = quantize_rows(x)
    out = torch._scaled_mm(
        xq, w.weight.t(), scale_a=xs, scale_b=w.scale.view(1, -1), out_dtype=x.dtype
    )[:m]
    return out if bias is None else out + bias
