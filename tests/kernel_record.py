"""Triton launches recorded instead of run, on the CPU: what each launch would be compiled for.

``recording`` makes every public kernel take its Triton path for CPU tensors (``kernels``'
dispatch answers "Triton" for any tensor, an H200's 132 SMs where a plan asks) and replaces
``JITFunction.run``: each launch's specialisation is computed by Triton's own binder for an
sm_90 target (argument types, integers equal to 1 or divisible by 16, pointers' 16-byte
alignment, constexprs, launch options: what its in-memory cache is keyed on) and recorded, and
nothing runs. Every floating-point tensor the launch takes is zeroed instead (but those of
``keep``: the weights and the KV pool, only read), so its outputs are zeros: the step goes on
with finite values, and a whole engine runs its scheduler, sampler and kernels' launch sites
with no GPU. Needs Triton installed (see ``tests/kernels/test_pdl_compile.py``); no compile happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

SMS = 132  # an H200's multiprocessors (decode attention's plans depend on them)


class Recorder:
    """The specialisation keys of the launches seen, per kernel name."""

    def __init__(self, keep: set[int]) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self._binders: dict[int, object] = {}
        self.keys: set[tuple[str, str]] = set()
        self.launches = 0
        self.keep = keep  # storages (data pointers) never zeroed

    def run(self, fn, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202, ARG002
        from triton.runtime.jit import create_function_from_signature

        binder = self._binders.get(id(fn))
        if binder is None:
            binder = create_function_from_signature(fn.signature, fn.params, self.backend)
            self._binders[id(fn)] = binder
        bound, specialization, options = binder(*args, **kwargs)  # type: ignore[operator]
        self.keys.add((fn.fn.__qualname__, str(specialization) + str(sorted(options.items()))))
        self.launches += 1
        for v in bound.values():
            if (
                isinstance(v, torch.Tensor)
                and v.is_floating_point()
                and v.untyped_storage().data_ptr() not in self.keep
            ):
                v.zero_()
        return None

    def names(self) -> set[str]:
        return {name for name, _ in self.keys}


def storages(*objs: object) -> set[int]:
    """The storages of every tensor in ``objs`` (tensors, dataclasses and lists of them)."""
    out: set[int] = set()

    def walk(o: object) -> None:
        if isinstance(o, torch.Tensor):
            out.add(o.untyped_storage().data_ptr())
        elif isinstance(o, list | tuple):
            for x in o:
                walk(x)
        elif hasattr(o, "__dataclass_fields__"):
            for name in o.__dataclass_fields__:  # type: ignore[attr-defined]
                walk(getattr(o, name))

    for o in objs:
        walk(o)
    return out


@contextlib.contextmanager
def recording(monkeypatch: pytest.MonkeyPatch, keep: set[int]) -> Iterator[Recorder]:
    """Record (not run) every Triton launch made inside, never zeroing the storages ``keep``;
    see the module's note."""
    import triton.runtime.jit as jit

    import kernels
    from kernels import _triton, triton_decode

    rec = Recorder(keep)
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    monkeypatch.setattr(_triton, "use_triton", lambda t: True)
    monkeypatch.setattr(_triton, "num_sms", lambda index: SMS)
    monkeypatch.setattr(triton_decode, "num_sms", lambda index: SMS)
    monkeypatch.setattr(jit.JITFunction, "run", lambda fn, *a, **k: rec.run(fn, *a, **k))
    yield rec
