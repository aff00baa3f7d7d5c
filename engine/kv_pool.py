"""The KV pool tensor: head-major storage (``libkv.kv_layout``), the view the kernels read, and
block bytes in and out.

Storage is ``[num_blocks, kv_heads, num_layers, 2, block_size, head_dim]``, contiguous: block
``i`` is one byte range, and a range of its heads is one byte range too. The kernels take the
permuted view ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` (the layout they
document; they address it through its strides), so the model code is the same either way.
"""

from __future__ import annotations

import os

import torch

from libkv.kv_layout import KVLayout

# Host pools live in a memfd, so that another process of this host (the worker around an
# engine process, ``engine.core.process``) maps the same pages: storage data pointer -> fd.
_MEMFDS: dict[int, int] = {}


def allocate(
    layout: KVLayout, rank: int, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zeroed pool of ``num_blocks`` blocks holding rank ``rank``'s heads (in a memfd on the
    host, where the platform has them)."""
    lo, hi = layout.heads(rank)
    shape = (num_blocks, hi - lo, layout.num_layers, 2, layout.block_size, layout.head_dim)
    if device.type != "cpu" or not hasattr(os, "memfd_create"):
        return torch.zeros(shape, device=device, dtype=dtype)
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    fd = os.memfd_create(f"tandem-kv-rank{rank}")  # close-on-exec: no child inherits it
    os.ftruncate(fd, max(nbytes, 1))  # zero pages
    pool = map_memfd(f"/proc/self/fd/{fd}", shape, dtype, nbytes)
    _MEMFDS[pool.untyped_storage().data_ptr()] = fd
    return pool


def memfd_of(pool: torch.Tensor) -> int | None:
    """The memfd holding ``pool`` (made by `allocate`), or None."""
    return _MEMFDS.get(pool.untyped_storage().data_ptr())


def map_memfd(path: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A pool tensor over the shared pages of the memfd at ``path`` (``/proc/PID/fd/FD``)."""
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=max(nbytes, 1))
    strides = _contiguous_strides(shape)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides)  # type: ignore[arg-type]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def kernel_view(pool: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` over the same memory."""
    return pool.permute(0, 2, 3, 4, 1, 5)


def read_bytes(pool: torch.Tensor, block_ids: list[int]) -> list[bytes]:
    """The raw bytes of each block of this pool."""
    idx = torch.tensor(block_ids, device=pool.device)
    blocks = pool[idx].cpu().contiguous()
    return [b.view(torch.uint8).numpy().tobytes() for b in blocks]


def write_bytes(pool: torch.Tensor, block_ids: list[int], data: list[bytes]) -> None:
    """Copy raw block bytes (this pool's blocks) into ``block_ids``."""
    shape = pool.shape[1:]
    for block_id, raw in zip(block_ids, data, strict=True):
        src = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        pool[block_id].copy_(src.view(pool.dtype).view(shape))


def assemble(layout: KVLayout, shards: list[list[bytes]]) -> list[bytes]:
    """Canonical blocks (every head in order) from each rank's bytes of the same blocks."""
    parts = layout.canonical_parts()
    out = []
    for i in range(len(shards[0])):
        out.append(
            b"".join(shards[p.src_rank][i][p.src_offset : p.src_offset + p.nbytes] for p in parts)
        )
    return out


def rank_part(layout: KVLayout, rank: int, canonical: bytes) -> bytes:
    """Rank ``rank``'s heads of a canonical block."""
    lo, hi = layout.heads(rank)
    return canonical[lo * layout.head_bytes : hi * layout.head_bytes]
