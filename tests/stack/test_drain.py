"""Graceful termination (what a Kubernetes rollout or scale-down does to a pod): on SIGTERM a
decode worker lets its running streams finish and a prefill worker stops taking prefills while
decode workers can still pull the KV blocks it holds; both then exit. Unit tests for the pieces
(closed admission, the drain loop, the liveness health service, the etcd mark) and one
end-to-end run on real processes."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from libkv.cluster.registry import Member, MemberLoad, MemberWatcher, Registration
from services.common.admission import TokenLedger
from services.common.errors import Unavailable
from services.common.grpc_server import LIVENESS_SERVICE, start_server
from services.common.health import Health
from services.launcher.etcd import EtcdServer, free_port
from services.launcher.stack import Stack, StackConfig
from services.worker.runtime import drain
from tests.stack_probe import worker_stats

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_closed_ledger_refuses_new_work_and_keeps_what_it_has() -> None:
    ledger = TokenLedger(1000, name="decode worker d0")
    ledger.admit("running", 10)
    ledger.close()
    with pytest.raises(Unavailable, match="draining"):
        ledger.admit("new", 10)
    assert list(ledger.inflight) == ["running"]
    ledger.release("running")
    assert ledger.inflight == {}


class FakeRegistration:
    def __init__(self) -> None:
        self.drained = 0

    async def drain(self) -> None:
        self.drained += 1


async def test_drain_waits_until_the_work_in_flight_is_done() -> None:
    registration = FakeRegistration()
    inflight = [3]

    async def finish_one_by_one() -> None:
        while inflight[0]:
            await asyncio.sleep(0.05)
            inflight[0] -= 1

    task = asyncio.create_task(finish_one_by_one())
    start = time.monotonic()
    left = await drain(registration, lambda: inflight[0], timeout=10)  # type: ignore[arg-type]
    assert left == 0 and task.done()
    assert 0.1 <= time.monotonic() - start < 5
    assert registration.drained == 1


async def test_drain_gives_up_at_its_timeout() -> None:
    start = time.monotonic()
    assert await drain(None, lambda: 2, timeout=0.3) == 2
    assert 0.3 <= time.monotonic() - start < 2


async def test_liveness_stays_serving_while_readiness_drains() -> None:
    handle = await start_server([], ["tandem.v1.Decode"], "127.0.0.1:0", ready=False)
    health = await Health(handle).start()
    async with grpc.aio.insecure_channel(handle.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            return reply.status

        assert await status("") == SERVING and await status(LIVENESS_SERVICE) == SERVING
        await health.drain()  # draining: not ready, still alive
        assert await status("") == NOT_SERVING and await status(LIVENESS_SERVICE) == SERVING
        assert await status("tandem.v1.Decode") == NOT_SERVING
        await health.stop()
        await handle.stop(grace=None)


async def test_health_starts_not_ready_and_tells_live_from_ready() -> None:
    """The way router and workers report health: not ready until the first good check, not
    live (nor ready) once a vital part died, extra names (a router's ``model:NAME``) ready
    only while the service is."""
    handle = await start_server([], ["tandem.v1.Router"], "127.0.0.1:0", ready=False)
    live, routable = [True], [False]
    async with grpc.aio.insecure_channel(handle.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            return reply.status

        assert await status("") == NOT_SERVING  # bound, not yet ready
        health = await Health(
            handle, live=lambda: live[0], extra=lambda: {"model:m": routable[0]}
        ).start()
        assert await status("") == SERVING and await status("model:m") == NOT_SERVING
        routable[0] = True
        await health.update()
        assert await status("model:m") == SERVING
        live[0] = False  # e.g. a worker's engine step thread died
        await health.update()
        assert await status(LIVENESS_SERVICE) == NOT_SERVING
        assert await status("") == NOT_SERVING and await status("model:m") == NOT_SERVING
        await health.stop()
    await handle.stop(grace=None)


@pytest.mark.timeout(60)
async def test_draining_member_stays_registered_but_is_not_routed_to(tmp_path) -> None:
    with EtcdServer(tmp_path) as etcd:
        watcher = await MemberWatcher.start(etcd.endpoint)
        member = Member("p0", "prefill", "m", "127.0.0.1:1", extra={"nixl": "agent"})
        calls = [0]

        def slow_load() -> MemberLoad:
            # Like a worker's load function waiting on the engine lock: the refresh thread
            # holds an old copy of the member while drain() marks it.
            time.sleep(0.08)
            calls[0] += 1
            return MemberLoad(queue_length=calls[0])

        reg = await Registration.start(etcd.endpoint, member, ttl=2, refresh=0.2, load_fn=slow_load)
        try:
            assert await watcher.wait_for(lambda ms: "p0" in ms, 2)
            assert [m.worker_id for m in watcher.members_by_role("prefill")] == ["p0"]
            await reg.drain()
            assert await watcher.wait_for(lambda ms: ms["p0"].draining, 2)
            assert watcher.members_by_role("prefill") == []
            seen = watcher.members["p0"].load.queue_length
            await asyncio.sleep(0.8)  # refreshes with new load keep the mark and the agent
            assert watcher.members["p0"].load.queue_length > seen
            assert watcher.members["p0"].draining
            assert watcher.members["p0"].extra["nixl"] == "agent"
        finally:
            await reg.stop()
            await watcher.stop()


MODEL = "SmolLM2-135M-Instruct"
# Long enough to outlive the 5 s the servers' stop(grace) gives streams: on the 2-core CI
# machine the stream runs on for about 12 s after SIGTERM (10 tokens/s with the other traffic).
STREAM_TOKENS = 120
LONG = " ".join(f"Line {i}: the ship carried {i * 3} boxes to port {i % 4}." for i in range(40))


def terminate(stack: Stack, name: str) -> None:
    proc = stack.children[name].proc
    assert proc is not None and proc.poll() is None
    proc.send_signal(signal.SIGTERM)


def wait_exit(stack: Stack, name: str, timeout: float) -> int:
    proc = stack.children[name].proc
    assert proc is not None
    return proc.wait(timeout)


@pytest.mark.stack  # a stack of its own, drained in parts: `make test-stack`
@pytest.mark.timeout(300)
def test_sigterm_drains_decode_streams_and_prefill_hands_off(smol_dir, tmp_path) -> None:
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path),
        port=free_port(),
        num_prefill=1,
        num_decode=2,
        member_ttl=3,
        member_refresh=0.5,
        kv_transport="grpc",
        metrics=False,
        worker_args=("--drain-timeout", "90"),
    )
    with Stack(config) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)
        stream = client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=STREAM_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)  # the first token is out: the stream is running on one decode worker
        (busy,) = [n for n, s in worker_stats(stack).items() if s.running]
        terminate(stack, busy)
        # While it drains, new requests go to the other decode worker.
        other = client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert other.usage.completion_tokens == 4
        rest = list(chunks)
        assert rest[-1].usage.completion_tokens == STREAM_TOKENS  # the running stream was not cut
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        assert wait_exit(stack, busy, 30) == 0

        asyncio.run(prefill_hands_off_then_exits(stack, client))


async def prefill_hands_off_then_exits(stack: Stack, client: openai.OpenAI) -> None:
    """Prefill a prompt straight on the prefill worker (as a router would) and keep its KV
    blocks; SIGTERM the worker: it takes no new prefill and no new routed prompt, but stays
    until its blocks are pulled and released, then exits."""
    proc = stack.children["prefill-0"].proc
    assert proc is not None
    sampling = common_pb2.SamplingOptions(max_tokens=4, temperature=0.0)
    async with grpc.aio.insecure_channel(stack.children["prefill-0"].address) as channel:
        prefill = worker_pb2_grpc.PrefillStub(channel)
        prompt = list(range(1000, 1300))  # 300 tokens: several blocks
        reply = await prefill.Prefill(
            worker_pb2.PrefillRequest(request_id="held", token_ids=prompt, sampling=sampling)
        )
        assert reply.kv.block_ids
        terminate(stack, "prefill-0")
        await asyncio.sleep(1.5)
        assert proc.poll() is None  # waiting for the hand-off
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await prefill.Prefill(
                worker_pb2.PrefillRequest(request_id="late", token_ids=prompt, sampling=sampling)
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # A long prompt through the gateway no longer goes to it: decode prefills it.
        out = await asyncio.to_thread(
            client.completions.create, model=MODEL, prompt=LONG, max_tokens=4
        )
        assert out.usage.completion_tokens == 4
        pull = worker_pb2.PullBlocksRequest(
            request_id="held", incarnation=reply.kv.incarnation, block_ids=reply.kv.block_ids
        )
        chunks = [c async for c in worker_pb2_grpc.KVTransportStub(channel).PullBlocks(pull)]
        assert len(chunks) == len(reply.kv.block_ids)
        await prefill.Release(worker_pb2.ReleaseRequest(request_id="held"))
    assert await asyncio.to_thread(proc.wait, 30) == 0
