"""The stand-in decode worker of ``bench.router_relay``: a real grpc.aio Decode server,
registered in etcd as a live decode member the way a real worker registers, whose Generate
streams one token per step of a shared step clock, every stream at the same tick (as an engine
step emits every running stream's token at once). No model runs: the router under test sees
the message rate of a GPU engine on a machine whose CPU engine makes ~80 tokens/s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from libkv.cluster.registry import LORAS, Member, MemberLoad, Registration
from services.common.admission import BOUND_KEY

FIRST_TOKEN = 1000  # the i-th token of every stream is FIRST_TOKEN + i (the client checks order)
BLOCK_SIZE = 16
KV_BLOCKS = 1 << 16  # room for every stream the bench runs: never the limit
TEXT = " x"  # a text delta per token, as a detokenizing worker sends
# The router's channels ping every 2 s (services.common.channels): accept them as a worker does.
SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
]


class StepClock:
    """Ticks every ``step_s`` on a fixed grid from its start; `tick` waits for the next one.
    Lateness (tick fired past its grid time, e.g. the harness's loop was busy) is recorded."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.t0 = time.monotonic()
        self.ticks = 0
        self.late_s: list[float] = []
        self._next: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name="step-clock")

    async def _run(self) -> None:
        k = 0
        while True:
            k += 1
            due = self.t0 + k * self.step_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            self.late_s.append(now - due)
            if now - due > self.step_s:  # fell behind: skip missed ticks, as a slow step would
                k = int((now - self.t0) / self.step_s)
            self.ticks += 1
            fired, self._next = self._next, asyncio.get_running_loop().create_future()
            fired.set_result(now)

    def tick(self) -> asyncio.Future[float]:
        """The next tick (its result: the time it fired)."""
        return self._next

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@dataclass(slots=True)
class ProbeTiming:
    """When a request reached the stand-in and when its first token left it."""

    arrived: float
    first_sent: float = 0.0


@dataclass(slots=True)
class StandInState:
    running: int = 0
    tokens_sent: int = 0
    generates: int = 0
    reserves: int = 0
    aborts: int = 0
    # Probes only: ids named ``probe-*``, or asking for one token (a gateway names its own ids).
    timings: dict[str, ProbeTiming] = field(default_factory=dict)


class StandInDecode(worker_pb2_grpc.DecodeServicer):
    """The Decode service a router calls on a decode-only request: Generate (and Reserve,
    Unreserve, Abort, Stats with plausible replies). Generate honours ``max_tokens``; its i-th
    token is ``script[i % len(script)]`` (token id, text) when a script is given, else
    ``FIRST_TOKEN + i`` with the text `TEXT`; each step's event carries ``per_step`` tokens (a
    worker that merges a step's tokens for a reader that lags sends several)."""

    def __init__(
        self, clock: StepClock, worker_id: str, script: Sequence[tuple[int, str]] = (),
        per_step: int = 1,
    ) -> None:  # fmt: skip
        self.clock = clock
        self.per_step = per_step
        self.worker_id = worker_id
        self.script = tuple(script)
        self.incarnation = ""
        self.state = StandInState()

    async def Generate(self, request, context):  # noqa: N802 - generated name
        s = self.state
        rid = request.request_id
        probe = rid.startswith("probe-") or request.sampling.max_tokens == 1
        timing = ProbeTiming(time.monotonic()) if probe else None
        if timing is not None:
            s.timings[rid] = timing
        n = max(request.sampling.max_tokens, 1)
        script = self.script
        s.generates += 1
        s.running += 1
        try:
            for i in range(0, n, self.per_step):
                await self.clock.tick()
                ids = range(i, min(i + self.per_step, n))
                toks = [script[j % len(script)] if script else (FIRST_TOKEN + j, TEXT) for j in ids]
                ev = common_pb2.TokenEvent(
                    request_id=rid, token_ids=[t for t, _ in toks], text="".join(x for _, x in toks)
                )
                if ids[-1] == n - 1:
                    ev.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    ev.usage.prompt_tokens = len(request.token_ids)
                    ev.usage.completion_tokens = n
                if timing is not None and i == 0:
                    timing.first_sent = time.monotonic()
                s.tokens_sent += len(ids)
                yield ev
        finally:
            s.running -= 1

    async def Reserve(self, request, context):  # noqa: N802
        self.state.reserves += 1
        return worker_pb2.ReserveResponse()

    async def Unreserve(self, request, context):  # noqa: N802
        return worker_pb2.UnreserveResponse(found=False)

    async def Abort(self, request, context):  # noqa: N802
        self.state.aborts += 1
        return common_pb2.AbortResponse(found=False)

    async def Stats(self, request, context):  # noqa: N802
        return common_pb2.WorkerStats(
            worker_id=self.worker_id, incarnation=self.incarnation, running=self.state.running,
            kv_blocks_total=KV_BLOCKS, integrity_ok=True, role="decode",
        )  # fmt: skip

    def load(self) -> MemberLoad:
        """What a real decode worker reports each refresh: its batch and its measured step."""
        used = min(self.state.running * 2, KV_BLOCKS)
        return MemberLoad(
            running=self.state.running, kv_blocks_used=used, kv_blocks_free=KV_BLOCKS - used,
            decode_step_ms=self.clock.step_s * 1000, max_batched_tokens=8192,
        )  # fmt: skip


@dataclass
class StandIn:
    """A started stand-in: its server, its etcd registration and its clock."""

    servicer: StandInDecode
    server: grpc.aio.Server
    registration: Registration
    clock: StepClock
    address: str

    @classmethod
    async def start(
        cls, etcd: str, model: str, step_s: float, worker_id: str = "relay-decode-0",
        script: Sequence[tuple[int, str]] = (), per_step: int = 1,
    ) -> StandIn:  # fmt: skip
        clock = StepClock(step_s)
        servicer = StandInDecode(clock, worker_id, script, per_step)
        # A bare server (no observing interceptors): the stand-in's own cost per event is the
        # harness's, and the 2-core machine has little to spare at GPU message rates.
        server = grpc.aio.server(options=SERVER_OPTIONS)
        worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        bound = f'{{"max_tokens": {KV_BLOCKS * BLOCK_SIZE}, "batch_fraction": 0.5}}'
        member = Member(
            worker_id=worker_id, role="decode", model=model, address=address,
            kv_blocks_total=KV_BLOCKS, block_size=BLOCK_SIZE,
            extra={BOUND_KEY: bound, LORAS: ""},
        )  # fmt: skip
        servicer.incarnation = member.incarnation
        reg = await Registration.start([etcd], member, load_fn=servicer.load)
        return cls(servicer, server, reg, clock, address)

    async def stop(self) -> None:
        await self.registration.stop()
        await self.server.stop(0.5)
        await self.clock.stop()
