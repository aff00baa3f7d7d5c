"""Per-request SLOs at the workers: the router sends each request's objectives in its worker
calls (PrefillRequest/DecodeRequest/ReserveRequest.slo) and a worker started with
--slo-shed-factor refuses a new request its measured pace already misses
(`services.worker.slo_gate`), while a started stream, a request without objectives and an idle
or unmeasured worker are never refused."""

from __future__ import annotations

import pytest
from tandem.v1 import common_pb2, worker_pb2

from engine.sampling_params import SamplingParams
from services.common.errors import ResourceExhausted
from services.decode.codec import job_from_pb
from services.decode.core import DecodeCore, DecodeJob
from services.router.calls import RouteJob
from services.router.codec import _slo
from services.worker.pace import PaceReport
from services.worker.slo_gate import SloGate, WorkerLoad


def gate(factor: float = 1.0, step_ms: float = 0.0, rate: float = 0.0, running: int = 0,
         backlog: int = 0) -> SloGate:  # fmt: skip
    return SloGate(
        factor, "w0", lambda: PaceReport(rate, step_ms), lambda: WorkerLoad(running, backlog)
    )


def test_decode_refuses_a_tpot_its_step_already_misses() -> None:
    busy = gate(step_ms=60, running=8)
    with pytest.raises(ResourceExhausted, match=r"60.0 ms at batch 8, past .* TPOT .* of 50 ms"):
        busy.admit_decode(50)
    busy.admit_decode(80)  # met: taken
    busy.admit_decode(0)  # no objective: the engine's behaviour as before
    gate(factor=1.5, step_ms=60, running=8).admit_decode(50)  # 60 <= 1.5 * 50
    gate(factor=0, step_ms=600, running=8).admit_decode(50)  # off
    gate(step_ms=600, running=0).admit_decode(50)  # idle: its figure is old, and it is free
    gate(step_ms=0, running=8).admit_decode(50)  # nothing measured yet


def test_prefill_refuses_a_ttft_its_queue_already_misses() -> None:
    queued = gate(rate=1000, backlog=3000)  # 3 s of queue
    with pytest.raises(ResourceExhausted, match="3000 prompt tokens queued take 3000 ms") as e:
        queued.admit_prefill(1000)
    assert e.value.retry_after_ms == 3000
    queued.admit_prefill(5000)
    queued.admit_prefill(0)
    gate(rate=0, backlog=3000).admit_prefill(1000)  # no measured rate
    gate(rate=1000, backlog=0).admit_prefill(1)  # empty queue


def test_the_router_sends_the_request_objectives_and_decode_reads_them() -> None:
    job = RouteJob("r1", [1, 2, 3], SamplingParams(max_tokens=4), slo_ttft_ms=800, slo_tpot_ms=30)
    slo = _slo(job)
    assert (slo.ttft_ms, slo.tpot_ms) == (800, 30)
    req = worker_pb2.DecodeRequest(
        request_id="r1", token_ids=[1, 2, 3], sampling=common_pb2.SamplingOptions(max_tokens=4),
        slo=slo,
    )  # fmt: skip
    decoded = job_from_pb(req)
    assert (decoded.slo_ttft_ms, decoded.slo_tpot_ms) == (800, 30)
    bare = job_from_pb(worker_pb2.DecodeRequest(request_id="r2", token_ids=[1]))
    assert (bare.slo_ttft_ms, bare.slo_tpot_ms) == (0, 0)  # none given


def core(g: SloGate) -> DecodeCore:
    # The engine is not reached: refusals happen before it, reservations are bookkeeping.
    return DecodeCore(None, None, "w0", "inc", gate=g)  # type: ignore[arg-type]


def test_decode_core_gates_reservations_and_new_streams_not_started_ones() -> None:
    c = core(gate(step_ms=60, running=4))
    with pytest.raises(ResourceExhausted, match="TPOT"):
        c.reserve("r1", 100, "interactive", 10.0, tpot_ms=50)
    assert c.num_reserved == 0 and not c.ledger.inflight
    c.reserve("r2", 100, "interactive", 10.0, tpot_ms=100)
    assert c.num_reserved == 1


async def test_decode_core_refuses_a_new_stream_before_the_engine() -> None:
    c = core(gate(step_ms=60, running=4))
    job = DecodeJob("r1", [1, 2], SamplingParams(max_tokens=4), slo_tpot_ms=50)
    with pytest.raises(ResourceExhausted, match="TPOT"):
        async for _ in c.generate(job):
            pass
    assert not c.ledger.inflight
