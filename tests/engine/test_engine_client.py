"""EngineClient: the event loop never waits on the engine, one message per step, cancellation
never leaks, slow readers get merged outputs; the engine in its own process gives the offline
engine's tokens, shares its pool, and its death is reported.

The first tests drive a fake engine (the client and its loop alone, ``EngineClient.local``);
the last ones the real engine with the bundled model, in a process of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine.core.client import EngineClient
from engine.core.messages import EngineInfo
from engine.core.process import EngineDied
from engine.errors import RequestNotFoundError
from engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from libkv.kv_layout import KVLayout

LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32", element_size=4, tp=1
)
INFO = EngineInfo(LAYOUT, 4, 10, LAYOUT.block_bytes, "float32", "cpu", "xxh3", 64, 1, False,
                  None, os.getpid())  # fmt: skip


class _KV:
    def set_listener(self, listener: object) -> None:
        self.listener = listener


class _Handoff:
    """The hand-off part of `SlowEngine`: a reservation takes ``seconds``; records which
    blocks are reserved."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.reserved: set[str] = set()
        self.num_held = 0

    def reserve(self, request_id: str, *_: object) -> tuple[list[int], int]:
        time.sleep(self.seconds)
        self.reserved.add(request_id)
        return [0], 0

    def release(self, request_id: str) -> bool:
        found = request_id in self.reserved
        self.reserved.discard(request_id)
        return found


class SlowEngine:
    """Sleeps ``step_seconds`` per step (one token per live request, ``max_tokens`` each) and
    ``add_seconds`` per add; records which requests are live (and, in ``handoff``, which
    blocks are reserved)."""

    def __init__(self, step_seconds: float = 0.3, add_seconds: float = 0.0) -> None:
        self.step_seconds = step_seconds
        self.add_seconds = add_seconds
        self.live: dict[str, int] = {}  # request id -> tokens produced
        self.handoff = _Handoff(step_seconds)
        self.max_tokens = 3
        self.kv = _KV()
        self.on_step = None

    def add_request(self, request_id: str, prompt: list[int], params: object, **_: object) -> None:
        time.sleep(self.add_seconds)
        self.live[request_id] = 0

    def abort(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is None:
            raise RequestNotFoundError(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def hold_planning(self, wake) -> float:  # no late planning: plan at once
        return 0.0

    def check_integrity(self) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(0, len(self.live), 10, 0, 0, 0, 0, 0)

    def close(self) -> None:
        self.closed = True

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_seconds)
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            n = self.live[rid]
            done = n >= self.max_tokens
            if done:
                del self.live[rid]
            outs.append(
                RequestOutput(
                    rid, [1], [n], str(n), [n], str(n), [], None, "length" if done else None, 0
                )  # fmt: skip
            )
        return outs


async def _longest_stall(work, tick: float = 0.01) -> float:
    """Run ``work`` while measuring the longest gap between event-loop ticks."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(tick)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = asyncio.create_task(ticker())
    try:
        await work
    finally:
        stop.set()
        await t
    return max(gaps)


async def _until(predicate, seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_streams_and_calls_never_stall_the_event_loop() -> None:
    fake = SlowEngine()
    client = await EngineClient.local(fake, INFO)  # type: ignore[arg-type]
    try:

        async def work() -> None:
            outs = [o async for o in client.generate("a", [1], SamplingParams())]
            assert [o.new_token_ids for o in outs] == [[1], [2], [3]] and outs[-1].finished
            gen = client.generate("b", [1], SamplingParams())
            await gen.__anext__()
            assert await client.release("nothing") is False  # a call waits for a step
            await gen.aclose()

        # every step sleeps 0.3 s; a loop that waited on the engine would stall that long
        assert await _longest_stall(work()) < 0.2
    finally:
        client.stop()


async def test_an_abandoned_stream_is_aborted() -> None:
    fake = SlowEngine(step_seconds=0.05)
    fake.max_tokens = 10**9
    client = await EngineClient.local(fake, INFO)  # type: ignore[arg-type]
    try:
        gen = client.generate("a", [1], SamplingParams())
        await gen.__anext__()
        await gen.aclose()
        await _until(lambda: "a" not in fake.live)
    finally:
        client.stop()


async def test_cancelling_an_add_never_leaks_the_request() -> None:
    fake = SlowEngine(step_seconds=0.01, add_seconds=0.3)
    fake.max_tokens = 10**9  # the request would live forever unless aborted
    client = await EngineClient.local(fake, INFO)  # type: ignore[arg-type]
    try:

        async def consume() -> None:
            async for _ in client.generate("a", [1], SamplingParams()):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)  # the engine is adding it
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: "a" not in fake.live and not client._streams)
    finally:
        client.stop()


async def test_a_cancelled_reservation_is_released() -> None:
    fake = SlowEngine(step_seconds=0.2)
    client = await EngineClient.local(fake, INFO)  # type: ignore[arg-type]
    try:
        task = asyncio.create_task(client.reserve("r", [1, 2], None, None))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: not fake.handoff.reserved and not client._calls)
    finally:
        client.stop()


async def test_a_slow_reader_gets_the_waiting_outputs_merged() -> None:
    fake = SlowEngine(step_seconds=0.01)
    fake.max_tokens = 12
    client = await EngineClient.local(fake, INFO)  # type: ignore[arg-type]
    try:
        reads = []
        async for out in client.generate("a", [1], SamplingParams()):
            reads.append(out)
            await asyncio.sleep(0.05)  # five steps pass per read
        tokens = [t for o in reads for t in o.new_token_ids]
        assert tokens == list(range(1, 13))  # every token once, in order
        assert len(reads) < 12 and any(len(o.new_token_ids) > 1 for o in reads)
        assert reads[-1].token_ids == tokens and reads[-1].text == "".join(map(str, tokens))
    finally:
        client.stop()


# -- the real engine, in its own process ---------------------------------------------------------
def _offline(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    for i, p in enumerate(prompts):
        engine.add_request(f"o{i}", p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return [done[f"o{i}"] for i in range(len(prompts))]


async def test_the_engine_process_matches_the_offline_engine_and_shares_its_pool(smol_dir):
    from engine.config import EngineConfig

    config = EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=64 << 20)
    offline = LLMEngine(config)
    prompts = [offline.tokenizer.encode(t) for t in ("The sky is", "Two plus two", "A cat")]
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = _offline(offline, prompts, params)
    client = await EngineClient.spawn(config)
    try:
        assert client.info.pid != os.getpid() and client.info.num_blocks == offline.pool.num_blocks

        async def run(i: int) -> list[int]:
            outs = [o async for o in client.generate(f"r{i}", prompts[i], params)]
            return outs[-1].token_ids

        assert await asyncio.gather(*(run(i) for i in range(3))) == expected
        # The worker's mapping of the pool is the engine's memory: what a step wrote is here.
        dst, cached = await client.reserve("h", prompts[0] * 4, None, None)
        data = await client.read_blocks(dst[:2])
        pool = client.pool()
        assert bytes(pool[dst[0]].view(-1).view(dtype=pool.dtype).numpy().tobytes()) == data[0]
        assert await client.release("h") and not await client.release("h")
        stats, held, ok = await client.worker_stats()
        assert ok and held == 0 and stats.kv_blocks_used == 0
    finally:
        client.stop()


async def test_the_engine_process_dying_fails_its_streams_and_is_reported(smol_dir):
    from engine.config import EngineConfig

    client = await EngineClient.spawn(
        EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=64 << 20)
    )
    deaths: list[str] = []
    client.on_death = deaths.append
    try:
        params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
        gen = client.generate("long", [1, 2, 3], params)
        await gen.__anext__()
        os.kill(client.info.pid, signal.SIGKILL)
        with pytest.raises(EngineDied):
            async for _ in gen:
                pass
        await _until(lambda: bool(deaths), 10)
        assert "exited with -9" in deaths[0] and not client.alive
        with pytest.raises(EngineDied):
            await client.worker_stats()
    finally:
        client.stop()


@pytest.mark.stack
def test_a_worker_whose_engine_process_dies_exits(smol_dir, tmp_path):
    """As a tensor-parallel rank's death does: the worker ends (ENGINE_DIED), so its member
    lease lapses and routers forget it, rather than live on unable to serve."""
    import subprocess
    import sys

    from engine.core.process import ENGINE_DIED
    from tests.stack.test_no_orphans import children_of

    log = tmp_path / "decode.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "services.decode", "--model-dir", str(smol_dir),
             "--kv-cache-bytes", str(64 << 20)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while "READY decode" not in log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        engines = [p for p, cmd in children_of(worker.pid).items() if "spawn_main" in cmd]
        assert len(engines) == 1, engines
        os.kill(engines[0], signal.SIGKILL)
        assert worker.wait(timeout=15) == ENGINE_DIED
        assert "the engine process is gone" in log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
