"""Guarded access to Triton: the package is optional (CPU hosts run the references)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Whether Triton imports and a CUDA device is present (checked once per process); where
    it does, its compiles are counted from here on (``kernels.compile_counter``)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    from kernels import compile_counter

    compile_counter.install()
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule of every public kernel: Triton for CUDA tensors when it imports."""
    return t.is_cuda and available()


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pdl_on(t: torch.Tensor, wanted: bool = True) -> bool:
    """Programmatic dependent launch for a launch on ``t``'s device, where ``wanted`` (the
    caller's ``KernelChoices.pdl``): Hopper or newer only (``griddepcontrol``); never off CUDA
    (Triton's interpreter)."""
    return wanted and t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9


def pdl_kwargs(t: torch.Tensor, wanted: bool = True) -> dict:
    """A taking-part kernel's launch options: ``PDL`` (its constexpr: ``griddepcontrol.wait``
    before it reads or writes anything) and ``launch_pdl`` where on (see `pdl_on`)."""
    on = pdl_on(t, wanted)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """float32 attention stays float32 (``ieee``); Triton's default would round to tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"
