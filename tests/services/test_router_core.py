"""Router decisions in isolation: fake member directory and fake worker clients (the real
path is covered end to end in test_e2e_stack)."""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from libkv.cluster.registry import Member, MemberLoad
from services.common.codec import Event, KVHandle
from services.common.errors import Unavailable
from services.router.calls import PrefillReply, RouteJob
from services.router.core import RouterCore


class Directory:
    def __init__(self, members: list[Member]) -> None:
        self.members = members

    def members_by_role(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]


def member(worker_id: str, role: str, queue: int = 0, used: int = 0) -> Member:
    return Member(
        worker_id,
        role,
        "m",
        f"{worker_id}:1",
        kv_blocks_total=100,
        load=MemberLoad(queue_length=queue, kv_blocks_used=used),
    )


HANDLE = KVHandle("p", "inc", "p:1", (1, 2), 20, 16, 64, "float32", 0)


class Clients:
    """Records calls; workers named in ``down`` fail with Unavailable before any event."""

    def __init__(self, down: set[str] = frozenset(), fail_after_first: bool = False) -> None:
        self.down = set(down)
        self.fail_after_first = fail_after_first
        self.calls: list[tuple[str, str]] = []
        self.released: list[str] = []
        self.reserved: list[str] = []  # decode workers booked before a prefill
        self.unreserved: list[str] = []

    async def prefill(self, worker, job):
        self.calls.append(("prefill", worker.worker_id))
        if worker.worker_id in self.down:
            raise Unavailable(f"{worker.worker_id} down")
        return PrefillReply(Event(job.request_id, [7], "x"), HANDLE)

    async def decode(self, worker, call):
        self.calls.append(("decode", worker.worker_id))
        if worker.worker_id in self.down:
            raise Unavailable(f"{worker.worker_id} down")
        yield Event(call.job.request_id, [8], "y")
        if self.fail_after_first:
            raise Unavailable("died mid-stream")
        yield Event(call.job.request_id, [9], "z", finish_reason="length")

    async def release(self, handle, request_id):
        self.released.append(request_id)

    async def reserve(self, worker, job, lease):
        self.reserved.append(worker.worker_id)

    async def unreserve(self, worker, request_id):
        self.unreserved.append(worker.worker_id)


def job(n_tokens: int) -> RouteJob:
    return RouteJob("r1", list(range(n_tokens)), SamplingParams(max_tokens=3))


async def collect(core: RouterCore, j: RouteJob) -> list[Event]:
    return [ev async for ev in core.generate(j)]


async def test_least_loaded_and_threshold():
    d = Directory(
        [
            member("p0", "prefill", queue=3),
            member("p1", "prefill"),
            member("d0", "decode", used=90),
            member("d1", "decode", used=10),
        ]
    )
    clients = Clients()
    core = RouterCore(d, clients, decode_only_threshold=256)
    await collect(core, job(10))
    assert clients.calls == [("decode", "d1")]  # short prompt: decode only, least KV used
    clients.calls.clear()
    events = await collect(core, job(300))
    assert clients.calls == [("prefill", "p1"), ("decode", "d1")]
    assert [e.token_ids for e in events] == [[7], [8], [9]]
    assert core.stats.decisions == {("least-loaded", "decode-only"): 1, ("least-loaded", "load"): 1}
    await asyncio.sleep(0)
    assert clients.released == []  # the decode worker took the KV: it releases it, not the router


async def test_retry_once_on_another_worker_before_first_token():
    d = Directory(
        [
            member("p0", "prefill"),
            member("p1", "prefill", queue=1),
            member("d0", "decode"),
            member("d1", "decode", queue=1),
        ]
    )
    clients = Clients(down={"p0"})
    core = RouterCore(d, clients)
    events = await collect(core, job(300))
    assert clients.calls == [("prefill", "p0"), ("prefill", "p1"), ("decode", "d0")]
    assert events[-1].finish_reason == "length" and core.stats.retries == 1

    clients = Clients(down={"d0", "d1"})
    core = RouterCore(d, clients)
    with pytest.raises(Unavailable):
        await collect(core, job(10))
    assert clients.calls == [("decode", "d0"), ("decode", "d1")]  # exactly one retry


async def test_a_stream_that_loses_its_worker_migrates_with_what_it_sent():
    """Dynamo-style migration: decode worker d0 dies after one token; d1 continues from the
    prompt plus that token (admitted, resumed), and the caller sees one stream."""

    class Dies(Clients):
        async def decode(self, worker, call):
            self.calls.append(("decode", worker.worker_id))
            self.resumed.append(list(call.resumed))
            assert call.admitted == bool(call.resumed)
            start = len(call.resumed)
            for i in range(start, 6):
                if worker.worker_id in self.down and i == start + 1:
                    raise Unavailable(f"{worker.worker_id} died mid-stream")
                yield Event(call.job.request_id, [10 + i], "t",
                            finish_reason="length" if i == 5 else None)  # fmt: skip

    def six() -> RouteJob:
        return RouteJob("r1", list(range(10)), SamplingParams(max_tokens=6))

    d = Directory([member("d0", "decode"), member("d1", "decode", queue=1),
                   member("d2", "decode", queue=2)])  # fmt: skip
    clients = Dies(down={"d0"})
    clients.resumed = []
    core = RouterCore(d, clients)
    events = await collect(core, six())
    assert [e.token_ids for e in events] == [[i] for i in range(10, 16)]  # none lost or repeated
    assert clients.calls == [("decode", "d0"), ("decode", "d1")]
    assert clients.resumed == [[], [10]] and core.stats.migrations == 1

    # Every worker dies after a token: two migrations (the default), then the error.
    clients = Dies(down={"d0", "d1", "d2"})
    clients.resumed = []
    core = RouterCore(d, clients)
    seen = []
    with pytest.raises(Unavailable, match="already migrated 2 times"):
        async for ev in core.generate(six()):
            seen.append(ev.token_ids)
    assert seen == [[10], [11], [12]] and clients.resumed == [[], [10], [10, 11]]
    assert core.stats.migrations == 2

    clients = Dies(down={"d0"})
    clients.resumed = []
    with pytest.raises(Unavailable, match="max-migrations 0"):
        await collect(RouterCore(d, clients, max_migrations=0), six())


async def test_prefilled_request_moves_to_another_decode_worker_before_its_tokens():
    """A decode worker that fails before sending a token (killed, still in the member view)
    does not fail a prefilled request: the client has only the first token, from prefill, so
    another decode worker continues from the same KV (and releases it: the router does not)."""
    d = Directory([member("p0", "prefill"), member("d0", "decode"),
                   member("d1", "decode", queue=1)])  # fmt: skip
    clients = Clients(down={"d0"})
    core = RouterCore(d, clients)
    events = await collect(core, job(300))
    assert [e.token_ids for e in events] == [[7], [8], [9]]
    assert clients.calls == [("prefill", "p0"), ("decode", "d0"), ("decode", "d1")]
    await asyncio.sleep(0)
    assert clients.released == [] and core.stats.retries == 1

    clients = Clients(down={"d0", "d1"})  # moved once; then the failure reaches the client
    with pytest.raises(Unavailable):
        await collect(RouterCore(d, clients), job(300))
    assert clients.calls == [("prefill", "p0"), ("decode", "d0"), ("decode", "d1")]


async def test_no_decode_workers_is_unavailable_and_no_prefill_falls_back():
    with pytest.raises(Unavailable, match="no live decode workers"):
        await collect(RouterCore(Directory([member("p0", "prefill")]), Clients()), job(300))
    clients = Clients()
    await collect(RouterCore(Directory([member("d0", "decode")]), clients), job(300))
    assert clients.calls == [("decode", "d0")]


async def test_abort_cancels_the_running_request():
    class Slow(Clients):
        async def decode(self, worker, call):
            yield Event(call.job.request_id, [1], "a")
            await asyncio.sleep(30)
            yield Event(call.job.request_id, [2], "b", finish_reason="length")

    core = RouterCore(Directory([member("d0", "decode")]), Slow())
    first = asyncio.Event()
    events = []

    async def consume_all():
        async for ev in core.generate(job(5)):
            events.append(ev)
            first.set()

    task = asyncio.ensure_future(consume_all())
    await asyncio.wait_for(first.wait(), 5)
    assert core.abort("r1") and not core.abort("unknown")
    await asyncio.wait_for(task, 5)  # the stream ends cleanly, with an abort event
    assert [e.finish_reason for e in events] == [None, "abort"]
    assert core.inflight["d0"] == 0


async def test_abort_while_the_handler_sends_an_event_still_ends_the_stream():
    """gRPC's handler task spends part of its life in gRPC's own send, between two of
    `generate`'s yields; a cancel landing there ended the RPC with no status at all (the
    client waited for its deadline; seen once in CI). The abort now waits for `generate` to
    resume, and the stream ends with an abort event all the same."""
    closed = []

    class Slow(Clients):
        async def decode(self, worker, call):
            try:
                for i in range(1000):
                    yield Event(call.job.request_id, [i], "a")
                    await asyncio.sleep(0.01)
            finally:
                closed.append(worker.worker_id)

    core = RouterCore(Directory([member("d0", "decode")]), Slow())
    in_send = asyncio.Event()
    events = []

    async def consume_all():  # as gRPC does: next event, then its own await to send it
        async for ev in core.generate(job(5)):
            events.append(ev)
            if len(events) == 3:
                in_send.set()
            await asyncio.sleep(0.2 if len(events) == 3 else 0)

    task = asyncio.ensure_future(consume_all())
    await asyncio.wait_for(in_send.wait(), 5)
    assert core.abort("r1")  # while consume_all waits in its "send"
    await asyncio.wait_for(task, 5)  # not cancelled: it ends with an abort event
    assert [e.finish_reason for e in events] == [None, None, None, "abort"]
    assert closed == ["d0"] and core.inflight["d0"] == 0
    assert not core.abort("r1")


async def test_kv_transfer_failure_prefills_again_on_another_worker():
    """Decode policy "retry": the decode worker could not obtain the KV from p0 (it died), so
    the router prefills again on p1 and decodes from that KV, keeping the first token."""
    from dataclasses import replace

    from services.common.errors import KVTransferFailed

    class LostKV(Clients):
        async def prefill(self, worker, job):
            reply = await super().prefill(worker, job)
            reply.first.token_ids = [7] if worker.worker_id == "p0" else [99]
            return replace(reply, handle=replace(HANDLE, worker_id=worker.worker_id))

        async def decode(self, worker, call):
            if call.handle is None:  # migrated: resumed from the token already streamed
                self.calls.append(("resume", worker.worker_id))
                assert call.resumed == [7] and call.admitted
                yield Event(call.job.request_id, [9], "z", finish_reason="length")
                return
            self.calls.append(("decode", call.handle.worker_id))
            if call.handle.worker_id == "p0":
                raise KVTransferFailed("p0 died mid-transfer")
            assert call.first.token_ids == [7]  # the token already streamed
            yield Event(call.job.request_id, [9], "z", finish_reason="length")

    d = Directory([member("p0", "prefill"), member("p1", "prefill", queue=1),
                   member("d0", "decode")])  # fmt: skip
    clients = LostKV()
    core = RouterCore(d, clients)
    events = await collect(core, job(300))
    assert [e.token_ids for e in events] == [[7], [9]]
    assert clients.calls == [("prefill", "p0"), ("decode", "p0"), ("prefill", "p1"),
                             ("decode", "p1")]  # fmt: skip
    assert core.stats.retries == 1
    await asyncio.sleep(0)
    assert clients.released == []  # each decode call took its KV: the decode worker releases

    # With no other prefill worker the stream migrates: resumed from its first token, on a
    # decode worker that recomputes the prompt.
    clients = LostKV()
    core = RouterCore(Directory([member("p0", "prefill"), member("d0", "decode")]), clients)
    events = await collect(core, job(300))
    assert [e.token_ids for e in events] == [[7], [9]]
    assert clients.calls[-1] == ("resume", "d0") and core.stats.migrations == 1


class CountingTokenizer:
    """A tokenizer that counts its calls: the router's only tokenizing is of text prompts."""

    def __init__(self) -> None:
        self.calls = 0

    def encode_prompt(self, text: str) -> list[int]:
        self.calls += 1
        return [ord(c) for c in text]


def test_token_id_prompts_are_not_tokenized_again_and_text_once() -> None:
    from tandem.v1 import router_pb2

    from services.router.codec import job_from_pb

    tok = CountingTokenizer()
    ids = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]))
    assert job_from_pb(ids, tok, "r1", None).prompt == [5, 6, 7]  # type: ignore[arg-type]
    assert tok.calls == 0  # what the gateway sends: ids, used as they are
    text = router_pb2.GenerateRequest(text="hi")
    assert job_from_pb(text, tok, "r2", None).prompt == [104, 105]  # type: ignore[arg-type]
    assert tok.calls == 1  # an internal caller's text: tokenized once, here


async def test_the_router_releases_only_kv_no_decode_worker_took():
    """One owner of a prefill's Release: the decode worker that took the KV; the router only
    when none did (here the only decode worker fails before its first event)."""
    d = Directory([member("p0", "prefill"), member("d0", "decode")])
    clients = Clients(down={"d0"})
    with pytest.raises(Unavailable):
        await collect(RouterCore(d, clients), job(300))
    await asyncio.sleep(0)
    assert clients.released == ["r1"]
    assert clients.unreserved == []  # the booking went to the Generate that failed
