"""The one interface workers use to reach their engine: `EngineClient`, on the event loop.

It sends commands to an engine core (`engine.core.loop.EngineLoop`), in its own process
(`spawn`, the worker's way: the engine never shares a GIL with gRPC) or on a thread here
(`local`, for tests and tools), and receives one message per step. Streams are rebuilt here
from each step's deltas: one wake-up of the event loop per step, not per token, and when a
reader falls behind, the outputs waiting for it are merged into one (its tokens, text and
logprobs joined), so a slow stream costs one message per read, not one per token.

Leaving a stream early (client gone, task cancelled) aborts the request, which frees its
blocks; a call cancelled after the engine ran it undoes what it took (a reservation).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from engine.core import process
from engine.core.messages import (
    Add,
    Call,
    Delta,
    EngineInfo,
    Failure,
    Listen,
    RankCall,
    Reply,
    Snapshot,
    StepMessage,
)
from engine.handoff import FirstToken, HeldKV
from engine.llm_engine import RequestOutput
from engine.request_output import merged
from engine.sampling_params import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)
Undo = Callable[[Any], None]


@dataclasses.dataclass(frozen=True, slots=True)
class Moved:
    """The last item of a stream whose request moved out (`EngineClient.move_out`)."""

    held: HeldKV


@dataclasses.dataclass(slots=True)
class _Choice:
    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    text: str = ""


class _Stream:
    """One request's outputs as they arrive, and its choices' cumulative state."""

    __slots__ = ("prompt", "params", "items", "ready", "choices")

    def __init__(self, prompt: list[int], params: SamplingParams) -> None:
        self.prompt = prompt
        self.params = params
        self.items: collections.deque = collections.deque()
        self.ready = asyncio.Event()
        self.choices: dict[int, _Choice] = {}

    def push(self, item: object) -> None:
        self.items.append(item)
        self.ready.set()

    def choice(self, index: int) -> _Choice:
        c = self.choices.get(index)
        if c is None:
            lps: list[TokenLogprob] | None = [] if self.params.logprobs is not None else None
            c = self.choices[index] = _Choice([], lps)
        return c

    def output(self, d: Delta) -> RequestOutput:
        """``d`` with this choice's cumulative fields (``text``: what this engine produced)."""
        c = self.choice(d.index)
        c.tokens.extend(d.new_token_ids)
        c.text += d.new_text
        if c.logprobs is not None:
            c.logprobs.extend(d.new_logprobs)
        return RequestOutput(
            d.request_id, self.prompt, list(c.tokens), c.text, d.new_token_ids, d.new_text,
            d.new_logprobs, c.logprobs, d.finish_reason, d.num_cached_tokens, d.stop_reason,
            d.kv_held, d.index, d.others_pending, d.handoff,
        )  # fmt: skip


class RankProxy:
    """A tensor-parallel engine's ranks 1..N-1 as the KV side calls them
    (``engine.parallel.ranks.RankGroup.call``), through the engine process."""

    def __init__(self, client: EngineClient, size: int) -> None:
        self.client = client
        self.size = size

    def call(self, rank: int, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        return self.client._rank_call(rank, fn, args)


class EngineClient:
    """An engine reached by messages. Every method runs on the event loop that started it."""

    def __init__(self, channel: Any, info: EngineInfo, local_engine: Any = None) -> None:
        self.channel = channel
        self.info = info
        self._local = local_engine  # `local`: the engine itself (its pool needs no mapping)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, tuple[Any, Undo | None]] = {}
        self._ids = itertools.count()
        self._listener: Any = None
        self.host_listener: Any = None  # the host tier's entries (``set_host_listener``)
        self._pool: Any = None
        self.snapshot: Snapshot | None = None
        self.on_step: Callable[[Any], None] | None = None
        self.on_death: Callable[[str], None] | None = None
        self.dead: str = ""

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    async def spawn(
        cls, config: Any, log_level: str = "info", name: str = "engine"
    ) -> EngineClient:
        """The engine in a process of its own (``engine.core.process``); raises
        ``process.EngineDied`` with the reason when it cannot start."""
        channel = process.start(config, log_level, name)
        try:
            info = await asyncio.get_running_loop().run_in_executor(None, channel.wait_ready)
        except BaseException:
            channel.kill()
            raise
        client = cls(channel, info)
        await client._start()
        return client

    @classmethod
    async def local(cls, engine: Any, info: EngineInfo | None = None) -> EngineClient:
        """``engine`` (an ``LLMEngine``) driven from a thread of this process; ``info``: its
        facts (default: read off the engine)."""
        channel = LocalChannel(engine)
        info = info or process.engine_info(engine, share=False)
        client = cls(channel, info, local_engine=engine)
        await client._start()
        return client

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.channel.start(self._loop, self._dispatch)
        stats, held, _ = await self.worker_stats()
        self.snapshot = Snapshot(stats, held)

    @property
    def alive(self) -> bool:
        return self.channel.alive and not self.dead

    @property
    def ranks(self) -> RankProxy | None:
        """Ranks 1..N-1 of a tensor-parallel engine (None at TP=1)."""
        if self.info.tensor_parallel_size <= 1:
            return None
        return RankProxy(self, self.info.tensor_parallel_size)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine (and its ranks); blocks until it is gone."""
        self.channel.close(timeout)

    def pool(self) -> Any:
        """This process's view of rank 0's KV pool (mapped once; None where it cannot be)."""
        if self._local is not None:
            return self._local.runner.kv_pool
        if self._pool is None and self.info.pool is not None:
            self._pool = map_pool(self.info)
        return self._pool

    # -- requests -------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        tenant: str | None = None,
        hold_kv: bool = False,
        priority: int = 0,
        lora: str | None = None,
        handoff_sums: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs (every choice's) until it finishes or hands
        its KV off (a prefill, ``hold_kv``: its last output carries ``handoff``)."""
        stream = self._open(request_id, prompt, params)
        await self._added(
            request_id,
            lambda cid: Add(
                cid, request_id, prompt, params, tenant, hold_kv, priority, lora, handoff_sums
            ),  # fmt: skip
        )
        async for out in self._drain(request_id, stream):
            yield out

    async def follow_prefilled(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        firsts: Sequence[FirstToken],
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """``Handoff.add_prefilled`` (``firsts``: each choice that goes on, from its first
        tokens; ``kwargs`` as there) and the request's outputs; their ``token_ids`` count the
        first tokens too."""
        stream = self._open(request_id, prompt, params)
        for f in firsts:
            c = stream.choice(f.index)
            c.tokens.extend(f.tokens)
            if c.logprobs is not None and f.logprob is not None:
                c.logprobs.append(f.logprob)
        firsts = list(firsts)
        await self._added(
            request_id,
            lambda cid: Call(
                cid,
                "add_prefilled",
                (request_id, prompt, None, params),
                {**kwargs, "firsts": firsts},
            ),  # fmt: skip
        )
        async for out in self._drain(request_id, stream):
            yield out

    async def move_out(self, request_id: str) -> HeldKV | None:
        """Take a running request out of the batch between two steps with its KV held
        (``Handoff.hold_for_move``); its stream then yields `Moved` last and ends."""
        held = await self._call("hold_for_move", request_id)
        if held is not None:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.push(Moved(held))
        return held

    async def abort(self, request_id: str) -> bool:
        """Abort a live request (or drop its held or reserved blocks). False if unknown."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.push(None)
        return bool(await self._call("abort", request_id))

    def _open(self, request_id: str, prompt: list[int], params: SamplingParams) -> _Stream:
        if request_id in self._streams:
            from engine.errors import InvalidRequestError

            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = _Stream(prompt, params)
        return stream

    async def _added(self, request_id: str, make: Callable[[int], object]) -> None:
        try:
            await self._send(make, undo=lambda _: self._fire("abort", request_id))
        except BaseException:
            self._streams.pop(request_id, None)
            raise

    async def _drain(self, request_id: str, stream: _Stream) -> AsyncIterator[Any]:
        done = False
        try:
            while not done:
                await stream.ready.wait()
                stream.ready.clear()
                for item in self._take(stream):
                    if item is None:  # aborted here
                        done = True
                        return
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item, Moved):
                        done = True
                        yield item
                        return
                    done = (item.finished or item.kv_held) and not item.others_pending
                    yield item
                    if done:
                        return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not done:  # the engine aborts it before its next step
                self._fire("abort", request_id)

    @staticmethod
    def _take(stream: _Stream) -> list[Any]:
        """Every item waiting, consecutive outputs of one choice merged into one."""
        out: list[Any] = []
        while stream.items:
            item = stream.items.popleft()
            prev = out[-1] if out else None
            if (
                isinstance(item, RequestOutput)
                and isinstance(prev, RequestOutput)
                and prev.index == item.index
                and not prev.closes
            ):
                out[-1] = merged(prev, item)
            else:
                out.append(item)
        return out

    # -- engine calls ---------------------------------------------------------------------------
    async def reserve(
        self, request_id: str, prompt: list[int], tenant: str | None, lora: str | None
    ) -> tuple[list[int], int]:
        """``Handoff.reserve``; released again if the caller is cancelled meanwhile."""
        return await self._call(
            "reserve", request_id, prompt, tenant, lora,
            undo=lambda _: self._fire("release", request_id),
        )  # fmt: skip

    async def release(self, request_id: str) -> bool:
        """Free held (prefill) or reserved (decode) blocks; False when there were none."""
        return bool(await self._call("release", request_id))

    def release_later(self, request_id: str) -> None:
        """`release` without waiting: done before the engine's next step (a caller being
        cancelled, or on a path that may not await)."""
        self._fire("release", request_id)

    async def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return await self._call("read_blocks", list(block_ids))

    async def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None:
        await self._call("write_blocks", list(block_ids), list(data))

    async def block_checksums(self, block_ids: list[int], algorithm: str | None = None):
        return await self._call("block_checksums", list(block_ids), algorithm)

    async def handoff_checksums(self, block_ids: list[int]) -> list[int]:
        return await self._call("handoff_checksums", list(block_ids))

    async def worker_stats(self) -> tuple[Any, int, bool]:
        """(EngineStats, held requests, whether the block bookkeeping is intact)."""
        return await self._call("worker_stats")

    async def add_lora(self, name: str, path: str) -> None:
        await self._call("add_lora", name, path)

    async def remove_lora(self, name: str) -> None:
        await self._call("remove_lora", name)

    async def list_loras(self) -> list[str]:
        return await self._call("list_loras")

    async def embed(self, ids: list[int], lora: str | None = None) -> list[float]:
        return await self._call("embed", ids, lora)

    async def prompt_logprobs(self, ids: list[int], k: int, lora: str | None = None):
        return await self._call("prompt_logprobs", ids, k, lora)

    @property
    def listener(self) -> Any:
        return self._listener

    def set_host_listener(self, listener: Any) -> None:
        """Report the host tier's entries to ``listener`` too (it hears nothing unless
        ``set_listener`` turned the engine's events on)."""
        self.host_listener = listener

    def set_listener(self, listener: Any) -> None:
        """Report the engine's cached and evicted prefix blocks to ``listener``
        (``libkv.kv_manager.CacheListener``), on the event loop, once per step."""
        self._listener = listener
        self.channel.send(Listen(listener is not None))

    async def _call(self, method: str, *args: Any, undo: Undo | None = None) -> Any:
        return await self._send(lambda cid: Call(cid, method, args), undo)

    def _fire(self, method: str, *args: Any) -> None:
        """A call whose result nobody waits for."""
        if not self.dead:
            self.channel.send(Call(next(self._ids), method, args))

    async def _send(self, make: Callable[[int], object], undo: Undo | None = None) -> Any:
        if self.dead:
            raise process.EngineDied(self.dead)
        assert self._loop is not None
        call_id = next(self._ids)
        fut = self._loop.create_future()
        self._calls[call_id] = (fut, undo)
        self.channel.send(make(call_id))
        return await fut

    def _rank_call(self, rank: int, fn: Any, args: tuple) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead:
            fut.set_exception(process.EngineDied(self.dead))
            return fut
        call_id = next(self._ids)
        self._calls[call_id] = (fut, None)
        self.channel.send(RankCall(call_id, rank, fn, args))
        return fut

    # -- messages -------------------------------------------------------------------------------
    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, StepMessage):
            self._on_step(msg)
        elif isinstance(msg, Reply):
            self._on_reply(msg)
        elif isinstance(msg, Failure):
            self._fail_streams(RuntimeError(msg.message))
        elif isinstance(msg, process.EngineDied):
            self._on_death(str(msg))

    def _on_step(self, msg: StepMessage) -> None:
        for d in msg.deltas:
            stream = self._streams.get(d.request_id)
            if stream is not None:
                stream.push(stream.output(d))
        if msg.cache_events and self._listener is not None:
            for ev in msg.cache_events:
                host = ev[0].startswith("host_")
                listener = self.host_listener if host else self._listener
                if listener is None:
                    continue
                if ev[0].endswith("cached"):
                    listener.cached(ev[1], ev[2], ev[3])
                else:
                    listener.evicted(ev[1])
        if self.on_step is not None:
            for step in msg.steps:
                self.on_step(step)
        if msg.snapshot is not None:
            self.snapshot = msg.snapshot

    def _on_reply(self, msg: Reply) -> None:
        entry = self._calls.pop(msg.call_id, None)
        if entry is None:
            return
        fut, undo = entry
        if isinstance(fut, concurrent.futures.Future):  # a rank call
            if msg.ok:
                fut.set_result(msg.value)
            else:
                fut.set_exception(msg.value)
            return
        if fut.cancelled():
            if msg.ok and undo is not None:
                undo(msg.value)
            return
        if msg.ok:
            fut.set_result(msg.value)
        else:
            fut.set_exception(msg.value)

    def _fail_streams(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.push(exc)

    def _on_death(self, why: str) -> None:
        closing = getattr(self.channel, "closing", False)
        self.dead = why
        exc = process.EngineDied(why)
        self._fail_streams(exc)
        calls, self._calls = self._calls, {}
        for fut, _ in calls.values():
            if not fut.done():
                fut.set_exception(exc)
        if not closing:
            log.critical("%s", why)
            if self.on_death is not None:
                self.on_death(why)


class LocalChannel:
    """The engine loop on a daemon thread of this process (tests and tools)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.closing = False
        self._loop: Any = None
        self._thread: Any = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.closing

    def start(self, loop: asyncio.AbstractEventLoop, dispatch: Callable[[object], None]) -> None:
        import threading

        from engine.core.loop import EngineLoop

        def deliver(msg: object) -> None:  # the loop's thread: once per step
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
                loop.call_soon_threadsafe(dispatch, msg)

        self._loop = EngineLoop(self.engine, deliver)
        self._thread = threading.Thread(target=self._loop.run, name="engine-step", daemon=True)
        self._thread.start()

    def send(self, msg: object) -> None:
        self._loop.submit(msg)

    def close(self, timeout: float = 10.0) -> None:
        from engine.core.messages import Stop

        if self.closing:
            return
        self.closing = True
        if self._loop is not None:
            self._loop.submit(Stop())
            self._thread.join(timeout)
        self.engine.close()


def map_pool(info: EngineInfo) -> Any:
    """Rank 0's pool of the engine process, mapped into this one (the same memory)."""
    import torch

    share = info.pool
    assert share is not None
    dtype = getattr(torch, share.dtype)
    if share.ipc:
        from libkv.transfer.cuda_ipc import IpcPool, open_pool

        flat = open_pool(IpcPool.from_json(share.ipc), torch.device(info.device))
        return flat.view(-1).view(dtype).view(share.shape)
    from engine import kv_pool

    return kv_pool.map_memfd(f"/proc/{share.pid}/fd/{share.fd}", share.shape, dtype, share.nbytes)
