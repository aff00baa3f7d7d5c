"""KV transfer over NIXL: the decode side (`NixlTransport`, a `KVTransport`) and the prefill
side (`NixlBlockServer`), speaking through NIXL notifications.

READ (decode pulls): decode READs the prefill blocks straight into its reserved blocks; the
  READ carries a ``rel`` notification, delivered after the data, on which prefill frees them.
WRITE (prefill pushes): decode sends ``push`` (source blocks, its pre-allocated destination
  blocks, its own agent info and a wall-clock deadline); prefill WRITEs the blocks with a
  ``done`` notification attached (delivered after the data) and frees them; on any failure it
  answers ``fail``. While waiting, decode probes prefill every ``probe_interval`` seconds, so a
  dead prefill worker gives an error in well under a second instead of a hang.

Timeouts: a transfer past its timeout is cancelled. A WRITE is never started after the push's
deadline and its own transfer is bounded by that deadline, so once decode has given up (and
frees its blocks) nothing writes into them any more. Messages are small JSON documents.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from libkv.transfer import (
    AgentInfo,
    BlockHolder,
    KVSource,
    KVTransferError,
    KVTransport,
    PeerDirectory,
    StalePeerError,
    TransferStats,
    agent_name,
)
from libkv.transfer.nixl_agent import NixlEndpoint

log = logging.getLogger(__name__)
MODES = ("read", "write")
# A transfer of GPU memory this large that moves slower than this is on an emulated or TCP
# path (UCX "software emulation", tcp/lo: ~12 MB/s seen between two workers of one H100),
# never on NVLink or RDMA (tens to hundreds of GB/s): the transport stops moving GPU memory.
SLOW_CHECK_BYTES = 4 * 1024**2
SLOW_BYTES_PER_S = 1e9


def _msg(kind: str, request_id: str, **fields: Any) -> bytes:
    return json.dumps({"t": kind, "rid": request_id, **fields}, separators=(",", ":")).encode()


def _parse(peer: str, raw: bytes) -> dict:
    """A notification as a dict; {} (ignored) for anything that is not one of ours."""
    try:
        msg = json.loads(raw)
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        log.warning("ignoring a notification from %s that is not ours: %r", peer, raw[:64])
        return {}
    return msg


class NixlTransport:
    """Decode side: obtains a request's blocks by READ or by asking prefill to WRITE them.

    Peers without a NIXL agent in their member record are served by ``fallback`` (the gRPC
    stream), so mixed deployments keep working. A decode worker also *serves* blocks over the
    same agent once ``serve`` is called (live KV migration: a draining decode worker's held
    blocks, READ by the worker taking its requests over), with a `NixlBlockServer` that gets
    this agent's notifications of that kind."""

    def __init__(
        self,
        endpoint: NixlEndpoint,
        peers: PeerDirectory,
        mode: str = "read",
        fallback: KVTransport | None = None,
        probe_interval: float = 0.2,
        on_slow: Callable[[str, float], None] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.endpoint = endpoint
        self.peers = peers
        self.mode = mode
        self.name = f"nixl-{mode}"
        self.fallback = fallback
        self.probe_interval = probe_interval
        # Called with (peer, bytes/s) when GPU memory moved slowly; None: no check (benchmarks
        # that measure the slow path).
        self.on_slow = on_slow
        self.gpu_direct = True  # False once GPU memory was seen on a slow path
        self.stats = TransferStats()
        self._agents: dict[str, str] = {}  # worker id -> agent name of its incarnation in use
        self._waiting: dict[tuple[str, str], asyncio.Future[dict]] = {}
        self._released: set[str] = set()  # requests whose release rode on the transfer
        self.server: NixlBlockServer | None = None  # set by ``serve``
        endpoint.start_pump(self._on_notif, busy=self._busy)

    def serve(
        self, holder: BlockHolder, busy: Callable[[], bool], whole_blocks: bool = True
    ) -> NixlBlockServer:
        """Serve ``holder``'s held blocks to peers over this agent (frees them on ``rel``,
        pushes them on ``push``); ``busy``: whether any are held; ``whole_blocks`` False for
        a tensor-parallel worker (peers READ rank by rank; no push)."""
        self.server = NixlBlockServer(self.endpoint, holder, busy, whole_blocks, pump=False)
        return self.server

    def _busy(self) -> bool:
        return bool(self._waiting) or (self.server is not None and self.server.busy())

    async def _peer(self, source: KVSource, timeout: float) -> AgentInfo | None:
        info = await self.peers.agent_info(source.worker_id, source.incarnation, timeout)
        if info is None:
            return None
        if info.name != agent_name(source.worker_id, source.incarnation):
            raise StalePeerError(f"{source.worker_id} runs agent {info.name}, not the handle's")
        if info.region.block_bytes != source.block_bytes:
            raise KVTransferError(
                f"{info.name} has {info.region.block_bytes}-byte blocks, handle says "
                f"{source.block_bytes}"
            )
        old = self._agents.get(source.worker_id)
        if old is not None and old != info.name:  # the worker restarted: drop its old agent
            await self.endpoint.forget(old)
        self._agents[source.worker_id] = info.name
        await self.endpoint.connect(info)
        return info

    async def fetch(
        self,
        request_id: str,
        source: KVSource,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout: float,
    ) -> str:
        if len(src_blocks) != len(dst_blocks):
            raise ValueError("src_blocks and dst_blocks differ in length")
        if not src_blocks:
            return self.name
        gpu = self.endpoint.region.mem_type == "VRAM"
        t0 = time.monotonic()
        try:
            if gpu and not self.gpu_direct:
                raise KVTransferError("NIXL moved GPU memory over a slow path; not used for it")
            info = await self._peer(source, timeout)
            if info is None:
                if self.fallback is None:
                    raise KVTransferError(f"{source.worker_id} has no NIXL agent")
                return await self.fallback.fetch(
                    request_id, source, src_blocks, dst_blocks, timeout
                )
            left = timeout - (time.monotonic() - t0)
            if self.mode == "read":
                notif = _msg("rel", request_id)
                await self.endpoint.transfer("READ", info.name, dst_blocks, src_blocks, notif, left)
            else:
                await self._push(request_id, source, info.name, src_blocks, dst_blocks, left)
        except KVTransferError:
            self.stats.failures += 1
            raise
        self._released.add(request_id)
        n, seconds = len(src_blocks), time.monotonic() - t0
        self.stats.add(n, n * source.block_bytes, seconds)
        if gpu and self.on_slow is not None:
            self._check_speed(source.worker_id, n * source.block_bytes, seconds)
        return self.name

    def _check_speed(self, peer: str, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-9)
        if nbytes < SLOW_CHECK_BYTES or rate >= SLOW_BYTES_PER_S:
            return
        self.gpu_direct = False
        log.error(
            "NIXL moved %d bytes of GPU memory from %s at %.3f GB/s: UCX is on an emulated or "
            "TCP path, not NVLink/RDMA; GPU memory no longer moves over NIXL from this worker",
            nbytes, peer, rate / 1e9,
        )  # fmt: skip
        assert self.on_slow is not None
        self.on_slow(peer, rate)

    async def _push(self, rid, source, peer, src_blocks, dst_blocks, timeout: float) -> None:
        assert self.endpoint.info is not None
        key = (peer, rid)
        fut: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        deadline = time.monotonic() + timeout
        request = _msg(
            "push",
            rid,
            inc=source.incarnation,
            src=list(src_blocks),
            dst=list(dst_blocks),
            agent=self.endpoint.info.to_json(),
            deadline_ms=int((time.time() + timeout) * 1000),
        )
        try:
            await self.endpoint.notify(peer, request)
            reply = await self._await_reply(fut, peer, deadline)
            if reply is None:  # timed out: make sure prefill stops, then give up
                with contextlib.suppress(KVTransferError):
                    await self.endpoint.notify(peer, _msg("cancel", rid))
                    await self._await_reply(fut, peer, time.monotonic() + 1.0)
                raise KVTransferError(f"push of {rid} from {peer} timed out after {timeout:.1f} s")
            if reply["t"] != "done":
                raise KVTransferError(f"{peer} could not push {rid}: {reply.get('why', '?')}")
        finally:
            self._waiting.pop(key, None)

    async def _await_reply(self, fut, peer: str, deadline: float) -> dict | None:
        """The peer's answer, None at the deadline; raises if a probe finds the peer gone."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                return await asyncio.wait_for(asyncio.shield(fut), min(left, self.probe_interval))
            except TimeoutError:
                await self.endpoint.notify(peer, b'{"t":"ping"}')

    def _on_notif(self, peer: str, raw: bytes) -> None:
        msg = _parse(peer, raw)
        if msg.get("t") in SERVED and self.server is not None:
            self.server.handle(peer, msg)
            return
        fut = self._waiting.get((peer, msg.get("rid", "")))
        if fut is not None and not fut.done() and msg.get("t") in ("done", "fail"):
            fut.set_result(msg)

    async def release(self, request_id: str, source: KVSource) -> None:
        if request_id in self._released:  # prefill frees on the READ's notification or its push
            self._released.discard(request_id)
            return
        with contextlib.suppress(KVTransferError):
            info = await self._peer(source, 1.0)
            if info is not None:
                await self.endpoint.notify(info.name, _msg("rel", request_id))
                return
        if self.fallback is not None:
            await self.fallback.release(request_id, source)

    async def close(self) -> None:
        if self.server is not None:
            self.server.cancel()
        await self.endpoint.close()
        if self.fallback is not None:
            await self.fallback.close()


SERVED = ("rel", "push", "cancel")  # the notifications a block server answers


class NixlBlockServer:
    """Serving side (a prefill worker, or a draining decode worker's moved requests): frees
    blocks on ``rel``, serves ``push`` by WRITE, honours ``cancel``. With ``pump`` False the
    owner of the endpoint's notification pump hands these to ``handle`` (`NixlTransport`)."""

    def __init__(
        self,
        endpoint: NixlEndpoint,
        holder: BlockHolder,
        busy: Callable[[], bool],
        whole_blocks: bool = True,
        pump: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.holder = holder
        # False for rank 0 of a tensor-parallel worker: its blocks hold only its KV heads, so it
        # refuses to push them (decode workers READ every rank's shard: libkv.transfer.sharded).
        self.whole_blocks = whole_blocks
        self.stats = TransferStats()
        self._cancelled: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task] = set()
        self._held_busy = busy
        if pump:
            endpoint.start_pump(self._on_notif, busy=self.busy)

    def busy(self) -> bool:
        """Blocks are held for peers, or a push is under way: notifications are due soon."""
        return self._held_busy() or bool(self._tasks)

    def _on_notif(self, peer: str, raw: bytes) -> None:
        self.handle(peer, _parse(peer, raw))

    def handle(self, peer: str, msg: dict) -> None:
        """Answer one (parsed) notification."""
        kind, rid = msg.get("t"), msg.get("rid", "")
        if kind == "rel":
            self.holder.release(rid)
        elif kind == "push":
            task = asyncio.create_task(self._push(peer, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif kind == "cancel":
            self._cancelled.add((peer, rid))

    async def _push(self, peer: str, msg: dict) -> None:
        rid, src, dst = msg["rid"], msg["src"], msg["dst"]
        held = False
        t0 = time.monotonic()
        try:
            info = AgentInfo.from_json(msg["agent"])
            if info.name != peer:
                raise KVTransferError(f"push from {peer} names agent {info.name}")
            await self.endpoint.connect(info)  # first: even a refusal is sent to it
            if not self.whole_blocks:
                raise KVTransferError("a tensor-parallel worker's blocks are READ rank by rank")
            self.holder.held_blocks(rid, msg["inc"], src)
            held = True
            left = msg["deadline_ms"] / 1000 - time.time()
            if left <= 0 or (peer, rid) in self._cancelled:
                raise KVTransferError("the push was cancelled or arrived after its deadline")
            await self.endpoint.transfer("WRITE", peer, src, dst, _msg("done", rid), left)
            self.stats.add(len(src), len(src) * self.endpoint.region.block_bytes,
                           time.monotonic() - t0)  # fmt: skip
        except Exception as e:
            self.stats.failures += 1
            log.warning("push of %s to %s failed: %s", rid, peer, e)
            with contextlib.suppress(KVTransferError):
                await self.endpoint.notify(peer, _msg("fail", rid, why=str(e)))
        finally:
            self._cancelled.discard((peer, rid))
            if held:  # decode either has the blocks or will not come back for them
                self.holder.release(rid)

    def cancel(self) -> None:
        """Stop the pushes under way (at shutdown)."""
        for task in list(self._tasks):
            task.cancel()

    async def close(self) -> None:
        self.cancel()
        await self.endpoint.close()
