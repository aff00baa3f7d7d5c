"""Launching Triton kernels through their compiled kernels once compiled (`FastLaunch`), and
the small helpers every such launch needs: the device a launch goes to, a pointer's 16-byte
alignment (what the variant is specialised on), a pointer argument as the launcher takes it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from triton import knobs

log = logging.getLogger(__name__)


class FastLaunch:
    """A Triton kernel launched through its compiled kernel once it has one.

    ``kernel[grid](...)`` spends tens of microseconds on the host per call in Triton 3.6
    (binding and specialising every argument, hashing the options into the cache key, the
    launch hooks' metadata) before the launch itself. The copy kernels here are launched
    with arguments whose specialisation the caller can name in a few values (``key``: the
    device, the pools' words and alignment, the index dtypes); the first call for a key goes
    through ``kernel[grid](...)``, which compiles (or finds) the variant and returns its
    ``CompiledKernel``; later calls for that key call the compiled kernel's launcher directly
    with the runtime arguments (pointers as ints, as Triton's launcher accepts them) and the
    current stream, as ``CompiledKernel.__getitem__``'s runner does.

    Any exception on that direct path (another Triton's calling convention, say) is logged
    once and the launcher goes back to ``kernel[grid](...)`` for good. Under Triton's
    interpreter (``TRITON_INTERPRET=1``) ``kernel[grid](...)`` returns no compiled kernel and
    every call takes it."""

    def __init__(self, kernel: Any, name: str) -> None:
        self.kernel = kernel
        self.name = name
        self.compiled: dict[Hashable, Any] = {}
        self.fast = 0  # launches that took the direct path (tests, bench)
        self.slow = 0  # launches through ``kernel[grid](...)``
        self.broken = False  # the direct path failed once: never tried again

    def __call__(
        self,
        key: Hashable,
        grid: tuple[int, int],
        fast_args: Callable[[], Sequence[Any]],
        slow_args: Callable[[], tuple[Sequence[Any], dict[str, Any]]],
        **options: Any,
    ) -> None:
        """Launch on the current device and stream. ``key``: everything the compiled variant
        depends on besides the kernel; ``fast_args()``: every kernel argument in order,
        constexprs included, pointers as ints or tensors; ``slow_args()``: the same as
        ``kernel[grid]`` takes them (tensors), the constexprs and ``options`` as keywords."""
        ck = None if self.broken else self.compiled.get(key)
        if ck is not None:
            try:
                self._direct(ck, grid, fast_args())
                self.fast += 1
                return
            except Exception as e:  # any kind: the slow path below still launches it
                self.broken = True
                log.warning("direct launch of %s failed (%r): back to kernel[grid]", self.name, e)
        args, constexprs = slow_args()
        got = self.kernel[grid](*args, **constexprs, **options)
        self.slow += 1
        if not self.broken and hasattr(got, "packed_metadata") and hasattr(got, "function"):
            self.compiled[key] = got  # a CompiledKernel (the interpreter returns none)

    @staticmethod
    def _direct(ck: Any, grid: tuple[int, int], args: Sequence[Any]) -> None:
        device = torch.cuda.current_device()
        stream = torch._C._cuda_getCurrentRawStream(device)
        enter = knobs.runtime.launch_enter_hook
        leave = knobs.runtime.launch_exit_hook
        run = ck.run  # loads the module on first use (the first launch did already)
        if getattr(enter, "calls", True) or getattr(leave, "calls", True):  # a profiler's
            meta = ck.launch_metadata((grid[0], grid[1], 1), stream, *args)
            run(grid[0], grid[1], 1, stream, ck.function, ck.packed_metadata, meta, enter,
                leave, *args)  # fmt: skip
        else:  # no hooks registered: nothing to call around the launch
            run(grid[0], grid[1], 1, stream, ck.function, ck.packed_metadata, None, None, None,
                *args)  # fmt: skip


def launch_device(t: torch.Tensor) -> int:
    """The device a launch for ``t`` goes to (Triton's: the current one); -1 off CUDA (the
    interpreter, which compiles nothing to keep)."""
    return torch.cuda.current_device() if t.is_cuda else -1


def aligned16(t: torch.Tensor) -> bool:
    """Whether ``t`` starts on 16 bytes (what Triton specialises a pointer on)."""
    return t.data_ptr() % 16 == 0


def pointer_arg(t: torch.Tensor) -> Any:
    """A pointer argument for Triton's launcher: a device tensor's address as an int; a host
    tensor itself (the launcher asks CUDA for its device address: pinned memory mapped)."""
    return t.data_ptr() if t.is_cuda else t
