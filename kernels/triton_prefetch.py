"""Triton L2 prefetch (issue 19): asks the L2 for a weight's bytes (``kernels.l2.Pattern``) and
loads nothing into registers, so it costs the SMs a few instructions and the DRAM bandwidth that
the kernels around it leave idle.

Order: prefetch ``u`` is the ``u // (rows * segs)``-th unit of range ``u % (rows * segs)``, so
the programs together go column by column over every range, the order in which a product's
programs stream their tiles: what the product reads first is asked for first.

Programmatic dependent launch (``kernels.PDL``): the step's kernels launch while the previous
one finishes and wait in the kernel (``griddepcontrol.wait``) for it, and only for it: the
immediately preceding grid. A kernel put into that chain must keep it: this one lets the next
kernel launch at once (``gdc_launch_dependents`` first: it reads nothing a kernel writes, only
weight addresses), issues its prefetches while the previous kernel still runs, and waits for
that kernel at its end (``gdc_wait`` last), so its own completion, which the next kernel waits
for, still implies the previous kernel's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import num_sms, pdl_kwargs
from kernels.l2 import BULK, LINE, Pattern

BLOCK = 512  # prefetches per program and step (4 warps: 4 a thread)
_ASM = {
    "line": "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
    "line_last": "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
    "bulk": "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
}


@triton.jit
def _l2_prefetch_kernel(
    w_ptr, total, ranges, segs, row_stride, seg_stride, row_bytes, head_bytes,
    UNIT: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr, BULK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # the next kernel may launch now; this one waits for the previous at its end
        tl.extra.cuda.gdc_launch_dependents()
    base = w_ptr.to(tl.pointer_type(tl.int8))
    for first in range(tl.program_id(0) * BLOCK, total, tl.num_programs(0) * BLOCK):
        u = tl.minimum(first + tl.arange(0, BLOCK), total - 1)  # past the end: the last again
        j = (u // ranges).to(tl.int64)
        r = u % ranges
        seg = (r % segs).to(tl.int64) * seg_stride
        end = seg + tl.minimum(head_bytes, row_bytes - seg)  # the last range ends with the row
        # past the range: its start again (bulk), or its last line (which a range that does not
        # start a line spills into)
        off = seg + j * UNIT
        off = tl.where(off < end, off, seg) if BULK else tl.minimum(off, end - 1)
        ptrs = base + (r // segs).to(tl.int64) * row_stride + off
        if BULK:  # bytes a multiple of 16 (lines, rows of 16-byte multiples), 16-byte aligned
            size = tl.minimum(end - off, UNIT).to(tl.int32)
            tl.inline_asm_elementwise(ASM, "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False,
                                      pack=1)  # fmt: skip
        else:
            tl.inline_asm_elementwise(ASM, "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:  # done only once the previous kernel is (see the module's docstring)
        tl.extra.cuda.gdc_wait()


def l2_prefetch(w: torch.Tensor, p: Pattern, asm: str = "line", programs: int = 0) -> None:
    """Ask the L2 for the bytes ``p`` of ``w`` (its first byte is the pattern's origin), from
    ``programs`` programs (0: one per SM). ``asm`` "bulk" needs Hopper and 16-byte aligned
    rows and ranges; elsewhere it takes "line". Nothing is read back or waited for."""
    if not w.is_cuda or p.rows * p.segs == 0 or p.head_bytes == 0:
        return
    aligned = w.data_ptr() % 16 == 0 and (p.row_bytes | p.row_stride | p.seg_stride) % 16 == 0
    if asm == "bulk" and not (aligned and torch.cuda.get_device_capability(w.device)[0] >= 9):
        asm = "line"
    unit = BULK if asm == "bulk" else LINE
    # ranges that do not start a line spill into one more
    spill = asm != "bulk" and (w.data_ptr() | p.row_stride | p.seg_stride) % LINE != 0
    total = p.units(unit, spill)
    if total >= 2**31:
        raise ValueError(f"{total} prefetches: at most 2**31 - 1 a launch")
    grid = min(programs or num_sms(w.device.index or 0), triton.cdiv(total, BLOCK))
    _l2_prefetch_kernel[(grid,)](
        w, total, p.rows * p.segs, p.segs, p.row_stride, p.seg_stride, p.row_bytes, p.head_bytes,
        UNIT=unit, BLOCK=BLOCK, ASM=_ASM[asm], BULK=asm == "bulk", num_warps=4, **pdl_kwargs(w),
    )  # fmt: skip
