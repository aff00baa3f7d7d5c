"""FP8 in the engine: the KV cache in e4m3 (``kv_cache_dtype="fp8"``) and weights in e4m3 with
per-channel scales made at load (``quantization="fp8"``), as vLLM names them.

- KV: each layer stores ``k / k_scale`` and ``v / v_scale`` in e4m3 and the attention kernels
  read it back scaled. The scales are per layer: the checkpoint's ``self_attn.k_scale`` and
  ``self_attn.v_scale`` where it has them, else 1.0 (vLLM's default). A block is half the bytes
  of bf16, and a hand-off moves half as much; both sides must use the same KV dtype (block
  sizes differ otherwise, and the decode worker refuses the hand-off).
- Weights: the four matrices of each layer (QKV, O, gate/up, down) become ``kernels.Fp8Weight``
  (e4m3 plus one float32 scale per output row); embeddings, norms and the LM head stay in the
  model dtype. Decode batches read them at one byte per weight (the skinny Triton kernel);
  larger batches run on the FP8 tensor cores (``torch._scaled_mm``).
- The LM head, with ``quantize_lm_head`` (a Tandem extension; vLLM keeps it unquantized): an
  ``Fp8Weight`` of its own like the layers' matrices (``quantize_head``). The embedding stays in
  the model dtype, so a model with tied embeddings then holds both. Its scales are per vocab
  row, so a tensor-parallel shard's rows carry exactly their own scales.

On CUDA both need FP8 support in hardware (compute capability 8.9 or newer: Ada, Hopper); the
CPU runs the pure-PyTorch references (dequantizing), for tests.
"""

from __future__ import annotations

import dataclasses

import torch

import kernels
from engine.errors import UnsupportedConfigError
from engine.model import LayerWeights

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("fp8",)
MIN_CAPABILITY = (8, 9)


def check_device(device: torch.device, what: str) -> None:
    """Refuse FP8 on a CUDA device without FP8 support, with the reason."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            raise UnsupportedConfigError(
                f"{what} needs a GPU with FP8 support (compute capability 8.9+: Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}"
            )


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The element type of the KV pool."""
    if kv_cache_dtype == "auto":
        return model_dtype
    check_device(device, f"--kv-cache-dtype {kv_cache_dtype}")
    return kernels.FP8


def quantize_layer(lw: LayerWeights) -> LayerWeights:
    """The layer with its four matrices in FP8 (per output channel); the rest unchanged."""

    def q(w: torch.Tensor | kernels.Fp8Weight) -> kernels.Fp8Weight:
        return w if isinstance(w, kernels.Fp8Weight) else kernels.quantize_fp8_rows(w)

    return dataclasses.replace(
        lw, qkv=q(lw.qkv), o_proj=q(lw.o_proj), gate_up=q(lw.gate_up), down=q(lw.down)
    )


# Rows of the LM head quantized at a time: its float32 copies stay at 2 x rows x hidden x 4
# bytes (128 MiB at hidden 4096) instead of two copies of the whole head (4 GiB for the 8B).
HEAD_CHUNK_ROWS = 4096


def quantize_head(w: torch.Tensor) -> kernels.Fp8Weight:
    """The LM head ``[vocab, hidden]`` in FP8 with one scale per vocab row, as
    ``kernels.quantize_fp8_rows`` makes it, a chunk of rows at a time (same values)."""
    weight = torch.empty(w.shape, dtype=kernels.FP8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for lo in range(0, w.shape[0], HEAD_CHUNK_ROWS):
        part = kernels.quantize_fp8_rows(w[lo : lo + HEAD_CHUNK_ROWS])
        weight[lo : lo + HEAD_CHUNK_ROWS] = part.weight
        scale[lo : lo + HEAD_CHUNK_ROWS] = part.scale
    return kernels.Fp8Weight(weight, scale)
