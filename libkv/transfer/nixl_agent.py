"""One NIXL agent per worker process: the KV pool registered once, descriptor lists prepared once
per peer, transfers built from block indices, notifications pumped to a callback.

Every call into the agent runs on one dedicated thread. The agent is created without thread
synchronisation (cheapest), and on a CPU host UCX moves host memory with ``cma`` (one
``process_vm_readv``/``writev`` per merged range) inside the post call itself: a post blocks for
the whole copy (about 1 s per GiB here), which must never stall the event loop. On GPU hosts
posts return at once and the transfer proceeds on the NIC / NVLink.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import importlib
import importlib.util
import logging
import sys
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from libkv.transfer import AgentInfo, KVTransferError, PoolRegion, block_runs

log = logging.getLogger(__name__)

_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
NotifCallback = Callable[[str, bytes], None]


@cache
def nixl_api() -> ModuleType | None:
    """NIXL's Python API (``nixl`` meta package or ``nixl-cu12``/``nixl-cu13``), or None."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def nixl_available() -> bool:
    return nixl_api() is not None


def ucx_cuda_problem() -> str | None:
    """Why NIXL's bundled UCX cannot move GPU memory device-direct here (cuda_copy/cuda_ipc
    modules missing or not loadable), or None when it can.

    UCX loads its CUDA modules at run time; when one fails to load (``libucm_cuda`` needs the
    CUDA runtime of the wheel's CUDA major version, which the wheel does not ship) UCX still
    runs, but moves GPU memory by "software emulation" over TCP. The runtime that PyTorch
    installed (``nvidia/*/lib/libcudart.so.N``) is loaded first, globally, so the modules find
    it."""
    for variant in ("nixl_cu13", "nixl_cu12"):
        spec = importlib.util.find_spec(variant)
        if spec is not None and spec.origin is not None:
            break
    else:
        return "NIXL is not installed"
    ucx = Path(spec.origin).parent.parent / f"{variant}.libs" / "ucx"
    modules = sorted(ucx.glob("libuct_cuda.so*")) + sorted(ucx.glob("libucm_cuda.so*"))
    if not modules:
        return f"{variant}'s UCX has no CUDA modules in {ucx}"
    _load_cuda_runtime("13" if variant.endswith("13") else "12")
    for module in modules:
        try:
            ctypes.CDLL(str(module), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            return f"{variant}'s UCX module {module.name} does not load: {e}"
    return None


def _load_cuda_runtime(major: str) -> None:
    for root in map(Path, sys.path):
        for lib in sorted(root.glob(f"nvidia/*/lib/libcudart.so.{major}*")):
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


def block_descs(region: PoolRegion) -> np.ndarray:
    """One (address, length, device) row per block: descriptor i is block i."""
    d = np.empty((region.num_blocks, 3), dtype=np.uint64)
    d[:, 0] = region.addr + np.arange(region.num_blocks, dtype=np.uint64) * region.block_bytes
    d[:, 1] = region.block_bytes
    d[:, 2] = region.device_id
    return d


class NixlEndpoint:
    """A worker's NIXL agent (UCX backend only) over its registered KV pool."""

    def __init__(self, name: str, region: PoolRegion, progress_thread: bool) -> None:
        self.name = name
        self.region = region
        self.progress_thread = progress_thread
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
        self._agent: Any = None
        self._local: Any = None  # prepared descriptor list of the local pool
        self._remote: dict[str, Any] = {}  # peer agent name -> its prepared descriptor list
        self._regions: dict[str, PoolRegion] = {}  # peer agent name -> its pool
        self.merged = 0  # transfers posted with contiguous runs merged into one descriptor
        self._leaked: list[Any] = []  # transfer handles that could not be cancelled
        self._pump: asyncio.Task | None = None
        self._active_until = 0.0  # poll fast until then: sends and wire-up need progress
        self.info: AgentInfo | None = None

    @classmethod
    async def start(
        cls, name: str, region: PoolRegion, progress_thread: bool | None = None
    ) -> NixlEndpoint:
        """Create the agent and register ``region``.

        ``progress_thread`` (default: only for GPU pools): NIXL's progress thread busy-polls
        UCX, one whole core per agent even when idle. On a 2-core CPU host that core is taken
        from the model and from the copy itself: 256 MiB READs in 128 KiB-2 MiB blocks ran at
        1.6-2.4 GB/s with it and 7-10 GB/s without it. Without it, UCX progresses whenever
        this endpoint polls a transfer or its notifications (the pump below), which it does
        every 0.5 ms while anything is pending.
        """
        if nixl_api() is None:
            raise KVTransferError("NIXL is not installed (pip install nixl-cu12)")
        if progress_thread is None:
            progress_thread = region.mem_type == "VRAM"
        self = cls(name, region, progress_thread)
        await self._call(self._init)
        return self

    def _init(self) -> None:
        api = nixl_api()
        assert api is not None
        r = self.region
        config = api.nixl_agent_config(enable_prog_thread=self.progress_thread, backends=["UCX"])
        self._agent = api.nixl_agent(self.name, config)
        self._agent.register_memory([(r.addr, r.nbytes, r.device_id, "")], r.mem_type)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(r), r.mem_type)
        self.info = AgentInfo(self.name, self._agent.get_agent_metadata(), r)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- peers --------------------------------------------------------------------------------
    def knows(self, peer: str) -> bool:
        return peer in self._remote

    async def connect(self, peer: AgentInfo) -> None:
        """Load a peer's metadata and prepare its descriptor list (once per peer agent)."""
        if peer.name not in self._remote:
            await self._call(self._connect, peer)

    def _connect(self, peer: AgentInfo) -> None:
        if peer.name in self._remote:
            return
        try:  # UCX connects here: a peer that just died fails it (NIXL_ERR_BACKEND)
            name = self._agent.add_remote_agent(peer.metadata)
        except Exception as e:
            raise KVTransferError(f"connecting to {peer.name} failed: {e!r}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != peer.name:
            self._agent.remove_remote_agent(name)
            raise KVTransferError(f"agent metadata names {name!r}, expected {peer.name!r}")
        r = peer.region
        try:
            descs = self._agent.prep_xfer_dlist(name, block_descs(r), r.mem_type)
        except Exception as e:
            self._agent.remove_remote_agent(name)
            raise KVTransferError(f"preparing {peer.name}'s blocks failed: {e!r}") from e
        self._remote[name] = descs
        self._regions[name] = r

    async def forget(self, peer: str) -> None:
        """Drop a peer (dead or replaced by a new incarnation): disconnects it."""
        if peer in self._remote:
            await self._call(self._forget, peer)

    def _forget(self, peer: str) -> None:
        dlist = self._remote.pop(peer, None)
        self._regions.pop(peer, None)
        if dlist is None:
            return
        with contextlib.suppress(Exception):
            self._agent.release_dlist_handle(dlist)
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(peer)

    # -- transfers ----------------------------------------------------------------------------
    async def transfer(
        self,
        op: str,
        peer: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        notif: bytes,
        timeout: float,
        parts: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """Run one READ or WRITE of whole blocks to completion, then send ``notif`` (so it
        reaches the peer after the data). Raises KVTransferError on failure or after
        ``timeout`` (the transfer is cancelled). ``parts``: move only these byte ranges of each
        block, ``(remote_offset, local_offset, nbytes)`` (a tensor-parallel rank's KV heads:
        `libkv.kv_layout.slice_plan`); empty: whole blocks.

        The notification is sent on its own once the transfer is DONE rather than attached to
        it: an attached one keeps the transfer in progress until UCX has the peer's answer,
        which cost ~1 ms per transfer here (single-block READ 1.7 ms, 0.35 ms without)."""
        deadline = time.monotonic() + timeout
        self._touch()
        handle, state = await self._call(
            self._post, op, peer, local_blocks, remote_blocks, notif, parts
        )
        delay = 0.0
        while state == "PROC":
            if time.monotonic() > deadline:
                await self._call(self._cancel, peer, handle)
                raise KVTransferError(f"{op} from {peer} timed out after {timeout:.1f} s")
            await asyncio.sleep(delay)
            delay = min(max(delay * 2, 1e-4), 1e-3)
            state = await self._call(self._state, handle, peer, notif)
        if state != "DONE":
            await self._call(self._cancel, peer, handle)
            raise KVTransferError(f"{op} of {len(local_blocks)} blocks with {peer} failed: {state}")

    def _post(
        self,
        op: str,
        peer: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        notif: bytes,
        parts: Sequence[tuple[int, int, int]] = (),
    ) -> tuple[Any, str]:
        remote = self._remote.get(peer)
        if remote is None:
            raise KVTransferError(f"unknown peer agent {peer!r}")
        runs = block_runs(local_blocks, remote_blocks)
        try:
            if parts:
                handle = self._parts_xfer(op, peer, runs, parts)
            elif len(runs) < len(local_blocks):  # contiguous runs: one descriptor each
                handle = self._merged_xfer(op, peer, runs)
            else:
                local_idx = np.asarray(local_blocks, dtype=np.int32)
                remote_idx = np.asarray(remote_blocks, dtype=np.int32)
                handle = self._agent.make_prepped_xfer(
                    op, self._local, local_idx, remote, remote_idx
                )
        except Exception as e:
            raise KVTransferError(f"preparing {op} with {peer} failed: {e!r}") from e
        try:
            state = self._agent.transfer(handle)
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer died
            return handle, repr(e)
        if state == "DONE":  # host memory over cma: copied inside the post itself
            return handle, self._finish(handle, peer, notif)
        return handle, self._state(handle, peer, notif)

    def _merged_xfer(self, op: str, peer: str, runs: list[tuple[int, int, int]]) -> Any:
        """A transfer whose descriptors are whole runs of consecutive blocks on both sides."""
        mine, theirs = self.region, self._regions[peer]
        local = np.array(
            [(mine.addr + a * mine.block_bytes, n * mine.block_bytes, mine.device_id)
             for a, _, n in runs], dtype=np.uint64,
        )  # fmt: skip
        remote = np.array(
            [(theirs.addr + b * theirs.block_bytes, n * theirs.block_bytes, theirs.device_id)
             for _, b, n in runs], dtype=np.uint64,
        )  # fmt: skip
        local_descs = self._agent.get_xfer_descs(local, mine.mem_type)
        remote_descs = self._agent.get_xfer_descs(remote, theirs.mem_type)
        self.merged += 1
        return self._agent.initialize_xfer(op, local_descs, remote_descs, peer)

    def _parts_xfer(
        self,
        op: str,
        peer: str,
        runs: list[tuple[int, int, int]],
        parts: Sequence[tuple[int, int, int]],
    ) -> Any:
        """A transfer of byte ranges of blocks: one descriptor per block and part (per run of
        blocks when the one part is whole blocks on both sides)."""
        mine, theirs = self.region, self._regions[peer]
        whole = len(parts) == 1 and parts[0] == (0, 0, mine.block_bytes) == (
            0,
            0,
            theirs.block_bytes,
        )
        local, remote = [], []
        for a, b, n in runs:
            if whole:
                local.append(
                    (mine.addr + a * mine.block_bytes, n * mine.block_bytes, mine.device_id)
                )
                remote.append((theirs.addr + b * theirs.block_bytes, n * theirs.block_bytes,
                               theirs.device_id))  # fmt: skip
                continue
            for i in range(n):
                for src_off, dst_off, nbytes in parts:
                    local.append((mine.addr + (a + i) * mine.block_bytes + dst_off, nbytes,
                                  mine.device_id))  # fmt: skip
                    remote.append((theirs.addr + (b + i) * theirs.block_bytes + src_off, nbytes,
                                   theirs.device_id))  # fmt: skip
        local_descs = self._agent.get_xfer_descs(np.array(local, dtype=np.uint64), mine.mem_type)
        remote_descs = self._agent.get_xfer_descs(
            np.array(remote, dtype=np.uint64), theirs.mem_type
        )
        return self._agent.initialize_xfer(op, local_descs, remote_descs, peer)

    def _state(self, handle: Any, peer: str, notif: bytes) -> str:
        """The transfer's state, polled on this thread for a while before handing back to the
        event loop (whose timers tick in whole milliseconds); finishes the transfer once DONE.

        Without a progress thread each poll progresses UCX, so poll tightly but briefly (the
        host-memory case finishes in tens of us); with one (GPU pools) only look, sleeping
        between looks so the GIL stays free, for up to 5 ms (a 64 MiB NVLink copy)."""
        spin = 5e-3 if self.progress_thread else 2e-4
        deadline = time.perf_counter() + spin
        try:
            while True:
                state = str(self._agent.check_xfer_state(handle))
                if state == "DONE":
                    return self._finish(handle, peer, notif)
                if state != "PROC" or time.perf_counter() > deadline:
                    return state
                if self.progress_thread:
                    time.sleep(1e-5)
        except Exception as e:
            return repr(e)

    def _finish(self, handle: Any, peer: str, notif: bytes) -> str:
        self._agent.release_xfer_handle(handle)
        if notif:
            try:
                self._agent.send_notif(peer, notif)
            except Exception as e:  # the data is in place; the peer's lease will free it
                log.warning("notifying %s after a transfer failed: %r", peer, e)
        return "DONE"

    def _cancel(self, peer: str, handle: Any) -> None:
        """Release (cancel) a transfer handle; if UCX cannot abort it, disconnect the peer,
        which fails its outstanding operations, and try again."""
        for attempt in range(2):
            try:
                self._agent.release_xfer_handle(handle)
                return
            except Exception as e:
                log.warning("cancelling a transfer with %s failed (%d): %r", peer, attempt, e)
                self._forget(peer)
        self._leaked.append(handle)

    # -- notifications -----------------------------------------------------------------------
    async def notify(self, peer: str, message: bytes) -> None:
        """Send a standalone notification; raises KVTransferError if the peer is unreachable."""
        self._touch()
        try:
            await self._call(self._agent.send_notif, peer, message)
        except Exception as e:
            raise KVTransferError(f"notifying {peer} failed: {e!r}") from e

    def _touch(self) -> None:
        """Without a progress thread UCX moves queued sends (and connection wire-up, several
        round trips) only when polled: poll fast for a moment after any activity."""
        self._active_until = time.monotonic() + 0.25

    def start_pump(
        self, callback: NotifCallback, busy: Callable[[], bool], idle_interval: float = 0.05
    ) -> None:
        """Deliver every incoming notification to ``callback(peer, message)`` on the event loop.

        Polls every ~1 ms while ``busy()`` (transfers or held blocks pending) or shortly after
        this endpoint sent something, else every ``idle_interval``; each poll also progresses
        UCX."""
        self._pump = asyncio.create_task(self._run_pump(callback, busy, idle_interval))

    async def _run_pump(self, callback: NotifCallback, busy, idle_interval: float) -> None:
        while True:
            fast = busy() or time.monotonic() < self._active_until
            try:
                got = await self._call(self._poll_notifs, fast and self.progress_thread)
            except Exception as e:  # never let the pump die
                log.warning("reading NIXL notifications failed: %r", e)
                got = {}
            for peer, messages in got.items():
                for m in messages:
                    try:
                        callback(peer, bytes(m))
                    except Exception:
                        log.exception("handling a notification from %s failed", peer)
            await asyncio.sleep(5e-4 if got or fast else idle_interval)

    def _poll_notifs(self, spin: bool) -> dict[str, list[bytes]]:
        """New notifications; with ``spin`` (GPU hosts, something pending) keep looking for up
        to 1 ms, as the event loop's next poll would come a millisecond later at best."""
        deadline = time.perf_counter() + (1e-3 if spin else 0.0)
        while True:
            got = self._agent.get_new_notifs()
            if got or time.perf_counter() > deadline:
                return got
            time.sleep(1e-5)

    async def close(self) -> None:
        """Flush what is still queued (polling UCX for a moment), then tear the agent down."""
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline and self._agent is not None:
            await self._call(self._agent.get_new_notifs)  # progress; messages here are moot
            await asyncio.sleep(0.005)
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        await self._call(self._close)
        self._thread.shutdown(wait=True)

    def _close(self) -> None:
        for peer in list(self._remote):
            self._forget(peer)
        if self._local is not None:
            with contextlib.suppress(Exception):
                self._agent.release_dlist_handle(self._local)
        self._agent = None
