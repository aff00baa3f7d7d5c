"""Counting Triton kernel compiles, before and after the engine is ready.

Triton compiles a kernel the first time a process launches it with a new specialisation (its
constexprs, argument dtypes, integers equal to 1 or divisible by 16, pointers' 16-byte
alignment, ``num_warps`` and ``num_stages``), or loads that variant from its on-disk cache
(``TRITON_CACHE_DIR``, see ``engine.warmup``): milliseconds for a load, up to seconds for a
compile, on the launching thread. Under serving load that is a stall of every stream in the
batch. The engine's warm-up meets every specialisation its shapes can reach before the worker
says READY; this module counts what still happens after, so that it shows as
``tandem_kernel_compiles_total{phase="serving"}`` and is logged, kernel and key, as a warning.

`install` hooks Triton's ``knobs.runtime.jit_post_compile_hook`` (called once per new
specialisation in a process, after the compile or the load) and ``knobs.compilation.listener``
(which tells the two apart), keeping any hooks already set. ``kernels._triton.available`` calls
it, so counting starts with the first kernel of the process.

Phases: ``warmup`` from `start_build` to `mark_ready` (the engine's build, warm-up included)
and inside `warming`; ``serving`` otherwise.
The counts are plain integers (`CompileCounts`), made to cross a process boundary in the
engine's stats. Imports nothing from Triton or torch until `install`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

WARMUP, SERVING = "warmup", "serving"


@dataclass(frozen=True, slots=True)
class CompileCounts:
    """New kernel specialisations met by this process, by phase; ``cached`` of them (either
    phase) were loaded from Triton's on-disk cache instead of compiled."""

    warmup: int = 0
    serving: int = 0
    cached: int = 0

    @property
    def total(self) -> int:
        return self.warmup + self.serving


class CompileCounter:
    """Thread-safe counts of compile events (`record`), split at `mark_ready`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = False
        self._warming = 0  # warm-ups in progress (engines built after the process was ready)
        self._counts = CompileCounts()

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def phase(self) -> str:
        return SERVING if self._ready and not self._warming else WARMUP

    def counts(self) -> CompileCounts:
        return self._counts

    def start_build(self) -> None:
        """An engine is being built: compiles count as ``warmup`` until its `mark_ready`.
        (An engine built while another serves in the same process, as tests do, counts the
        other's compiles as warm-up meanwhile; a build that fails leaves the phase at warm-up
        until the next one succeeds: a worker whose engine fails to build exits.)"""
        with self._lock:
            self._ready = False

    def mark_ready(self) -> None:
        """From now on compiles count as ``serving`` (outside `warming`); idempotent."""
        with self._lock:
            first = not self._ready
            self._ready = True
        c = self._counts
        if first and c.total:
            log.info("kernels: %d specialisations met in warm-ups, %d while serving, %d of all "
                     "from Triton's on-disk cache (%s)", c.warmup, c.serving, c.cached,
                     cache_dir())  # fmt: skip

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        """Compiles inside count as ``warmup`` even once the process is ready."""
        with self._lock:
            self._warming += 1
        try:
            yield
        finally:
            with self._lock:
                self._warming -= 1

    def record(self, kernel: str, key: str, cached: bool) -> str:
        """Count one new specialisation of ``kernel`` (``key``: what it is specialised on);
        returns its phase. One after ready is logged as a warning: the warm-up missed it."""
        with self._lock:
            phase = self.phase
            c = self._counts
            self._counts = CompileCounts(
                c.warmup + (phase == WARMUP), c.serving + (phase == SERVING), c.cached + cached
            )
        if phase == SERVING:
            how = "loaded from the cache" if cached else "compiled"
            log.warning("kernel %s %s after ready (the warm-up missed it): %s", kernel, how, key)
        return phase


COUNTER = CompileCounter()
_installed = False
_install_lock = threading.Lock()
_last = threading.local()  # the listener's cache_hit for the hook that follows it on this thread


def install() -> bool:
    """Hook Triton's compile path into `COUNTER` (once per process). False where Triton does
    not import."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        knobs.compilation.listener = _listener(knobs.compilation.listener)
        knobs.runtime.jit_post_compile_hook = _post_compile(knobs.runtime.jit_post_compile_hook)
        _installed = True
        return True


def _listener(previous: Callable[..., Any] | None) -> Callable[..., Any]:
    def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool):  # noqa: ANN202
        _last.cache_hit = cache_hit
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                     cache_hit=cache_hit)  # fmt: skip

    return listener


def _post_compile(previous: Callable[..., Any] | None) -> Callable[..., Any]:
    def hook(*, key: str, repr: str, fn: Any, compile: dict, is_manual_warmup: bool,  # noqa: A002, ANN202
             already_compiled: bool):  # fmt: skip
        cached = bool(getattr(_last, "cache_hit", False))
        _last.cache_hit = False
        COUNTER.record(getattr(fn, "name", str(fn)), describe(compile), cached)
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile,
                            is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)  # fmt: skip
        return None

    return hook


def describe(compile: dict) -> str:  # noqa: A002
    """A specialisation as Triton's compile hook gives it (``signature``, ``constants``,
    ``configs``, launch options), one line: each argument's type (``:16``: specialised as
    divisible by 16; constexprs and integers equal to 1 by value)."""
    sig: dict[str, str] = dict(compile.get("signature") or {})
    names = list(sig)
    consts = {p[0]: v for p, v in (compile.get("constants") or {}).items() if len(p) == 1}
    attrs = (compile.get("configs") or [{}])[0]
    divisible = {p[0] for p, a in attrs.items() if len(p) == 1 and "tt.divisibility" in str(a)}
    args = []
    for i, name in enumerate(names):
        if i in consts:
            args.append(f"{name}={consts[i]}")
        else:
            args.append(f"{name}:{sig[name]}" + (":16" if i in divisible else ""))
    opts = f"num_warps={compile.get('num_warps')}, num_stages={compile.get('num_stages')}"
    return f"[{opts}]({', '.join(args)})"


def cache_dir() -> str:
    """Where Triton keeps compiled kernels (``TRITON_CACHE_DIR``, else
    ``$TRITON_HOME/.triton/cache``, ``~/.triton/cache`` by default); "" without Triton."""
    try:
        from triton import knobs
    except ImportError:
        return ""
    return str(knobs.cache.dir)
