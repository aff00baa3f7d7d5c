"""Kernels behind one torch-level API.

Each public function here dispatches to a Triton kernel when the tensors live on CUDA and one
is available, and to the pure-PyTorch reference in ``kernels.reference`` otherwise. The engine
imports only this module, so swapping implementations needs no other change.
"""

from __future__ import annotations

from kernels.reference import (
    AttentionMetadata,
    copy_blocks,
    paged_attention,
    rms_norm,
    rotary_embedding,
    write_kv,
)

__all__ = [
    "AttentionMetadata",
    "copy_blocks",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "write_kv",
]
