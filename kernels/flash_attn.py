"""FlashAttention 3 over the paged pool, on Hopper, where its extension is installed.

The extension is vLLM's build of FlashAttention 3 (the ``_vllm_fa3_C`` module of the ``vllm``
wheel, ``vllm/vllm_flash_attn/``; BSD-3 like FlashAttention). It is looked for as
``vllm.vllm_flash_attn._vllm_fa3_C`` (vLLM installed) and as a top-level ``_vllm_fa3_C`` on
``sys.path`` (the one file taken out of that wheel: ``python -m bench.device.prepare --fa3``
does it for the GPU host). It is linked against one PyTorch release: vLLM 0.26.0's against
torch 2.11; another torch fails at import, and then this module says FA3 is not there.

It takes the same pool as the Triton kernels: block-major ``[N, L, 2, bs, Hkv, D]``; one
layer's K (and V) is a ``[N, bs, Hkv, D]`` view whose block stride spans every layer, which
FlashAttention's paged path reads through that stride. Block tables, lengths and query
offsets go in as int32 (converted once per step and shared by every layer).

Only bf16/fp16 caches are taken: FlashAttention 3's FP8 path wants the queries in FP8 too,
which changes the numbers the Triton FP8 kernels give; an FP8 pool keeps the Triton kernels.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kernels.reference import AttentionMetadata

MODULES = ("_vllm_fa3_C", "vllm.vllm_flash_attn._vllm_fa3_C")
DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 96, 128, 192, 256)


@cache
def _ops() -> Any:
    """``torch.ops._vllm_fa3_C`` (an op namespace) once its extension is imported, else None."""
    for name in MODULES:
        try:
            importlib.import_module(name)
        except (ImportError, OSError):
            continue
        return torch.ops._vllm_fa3_C
    return None


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FA3 cannot serve a pool of ``dtype`` with ``head_dim`` on ``device``; None if it can."""
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "FlashAttention 3 runs on compute capability 9.x (Hopper) only"
    if dtype not in DTYPES:
        return f"KV dtype {dtype} (FA3 is taken for bf16/fp16 pools only)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one FA3 is built for {HEAD_DIMS}"
    if _ops() is None:
        return f"no FA3 extension importable (tried {', '.join(MODULES)})"
    return None


def _int32_meta(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's query offsets, KV lengths and block tables as int32 (once per step)."""
    got = meta.scratch.get("fa3")
    if got is None:
        max_blocks = -(-meta.max_seq_len // meta.block_size)
        got = (
            meta.query_start_loc.to(torch.int32),
            meta.seq_lens.to(torch.int32),
            meta.block_tables[:, :max_blocks].to(torch.int32),
        )
        meta.scratch["fa3"] = got
    return got


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of the step's new tokens (``q``: ``[T, H, D]``, the last ``q_len``
    positions of each sequence) over their sequences' paged KV, as `kernels.paged_attention`;
    prefill chunks, decodes and both in one step alike. The causal mask is aligned to the end of
    each sequence (FlashAttention's bottom-right alignment), which is where the new tokens are.
    """
    ops = _ops()
    if ops is None:
        raise RuntimeError("FlashAttention 3 is not installed (kernels.flash_attn)")
    layer_kv = kv_cache.select(1, layer)
    k, v = layer_kv.select(1, 0), layer_kv.select(1, 1)
    cu_q, seqused_k, tables = _int32_meta(meta)
    out = torch.empty_like(q)
    ops.fwd(
        q, k, v, None, None, None, out,
        cu_q, None, None, None, seqused_k,
        meta.max_query_len, meta.max_seq_len,
        tables, None, None, None, None, None,
        None, None, None,
        scale, True, -1, -1, 0.0, True,
        None, 0, None, 0, None, 1, 0, None,
    )  # fmt: skip
    return out
