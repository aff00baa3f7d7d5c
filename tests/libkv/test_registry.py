"""Membership registry against a real etcd server (started on loopback by `EtcdServer`)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import textwrap
import time
from collections.abc import AsyncIterator, Iterator

import aetcd
import pytest

from libkv.cluster.registry import (
    Member,
    MemberChange,
    MemberLoad,
    MemberWatcher,
    Registration,
    member_key,
)
from services.launcher import etcd as etcd_server
from services.launcher.etcd import EtcdNotFoundError, EtcdServer, free_port
from tests.child import python_child

pytestmark = pytest.mark.timeout(60)

TTL, REFRESH = 2, 0.3
_ids = itertools.count()


def make_member(role: str = "prefill", **overrides) -> Member:
    """A member with a unique worker id, so tests sharing one etcd never see each other's."""
    fields: dict = dict(
        worker_id=f"w{next(_ids)}-{os.getpid()}",
        role=role,
        model="smollm2-135m",
        address="127.0.0.1:50051",
        kv_blocks_total=1024,
        block_size=16,
        extra={"nixl": "agent-md"},
    )
    fields.update(overrides)
    return Member(**fields)


class Counter:
    """A load_fn whose queue length grows by one per refresh."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> MemberLoad:
        self.calls += 1
        return MemberLoad(queue_length=self.calls, running=1, kv_blocks_used=2, kv_blocks_free=3)


async def eventually(condition, timeout: float) -> bool:
    """Poll ``condition()`` (state kept by a background task) until true or timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def present(worker_id: str):
    return lambda members: worker_id in members


def absent(worker_id: str):
    return lambda members: worker_id not in members


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def own_etcd(tmp_path) -> Iterator[EtcdServer]:
    """A server this test alone uses (it gets killed and restarted)."""
    with EtcdServer(tmp_path) as server:
        yield server


@pytest.fixture
async def watcher(etcd) -> AsyncIterator[MemberWatcher]:
    w = await MemberWatcher.start(etcd.endpoint)
    yield w
    await w.stop()


def test_member_json_round_trip_ignores_unknown_fields():
    m = make_member(load=MemberLoad(queue_length=4))
    assert Member.from_json(m.to_json()) == m
    raw = m.to_json().replace(b'{"worker_id"', b'{"future":[1],"worker_id"')
    raw = raw.replace(b'"queue_length"', b'"gpu_util":0.5,"queue_length"')
    assert Member.from_json(raw) == m
    assert len(m.incarnation) == 32 and m.incarnation != make_member().incarnation
    assert m.key == f"/tandem/v1/members/prefill/{m.worker_id}".encode()
    with pytest.raises(ValueError):
        member_key("trainer", "w")
    with pytest.raises(ValueError):
        member_key("decode", "a/b")


def test_missing_binary_names_the_package(monkeypatch):
    monkeypatch.setattr(etcd_server.shutil, "which", lambda name: None)
    monkeypatch.setattr(etcd_server.os, "access", lambda path, mode: False)
    with pytest.raises(EtcdNotFoundError, match="apt-get install etcd-server"):
        etcd_server.find_etcd_binary()


async def test_registered_member_appears_with_its_fields(etcd, watcher):
    m = make_member(role="decode")
    changes: list[MemberChange] = []
    watcher.add_listener(changes.append)
    reg = await Registration.start(etcd.endpoint, m, ttl=TTL, refresh=REFRESH)
    try:
        assert reg.registered and reg.lease_id
        assert await watcher.wait_for(present(m.worker_id), timeout=1.0)
        assert watcher.members[m.worker_id] == m
        assert watcher.members_by_role("decode") == [m]
        assert changes[-1] == MemberChange("put", m.worker_id, m)
        # A watcher started later gets it from the initial range read.
        late = await MemberWatcher.start(etcd.endpoint)
        assert late.members[m.worker_id] == m
        await late.stop()
    finally:
        await reg.stop()


async def test_load_updates_propagate_on_refresh(etcd, watcher):
    m, load = make_member(), Counter()
    reg = await Registration.start(etcd.endpoint, m, ttl=TTL, refresh=REFRESH, load_fn=load)
    try:

        def loaded(members):
            return m.worker_id in members and members[m.worker_id].load.queue_length >= 3

        assert await watcher.wait_for(loaded, timeout=2.0)
        got = watcher.members[m.worker_id]
        assert got.load.kv_blocks_free == 3 and got.incarnation == m.incarnation
        assert reg.registrations == 1  # refreshed, never re-registered
    finally:
        await reg.stop()


async def test_a_slow_load_function_does_not_lose_the_lease(etcd, watcher):
    """A worker's load function waits for the engine lock, held for a whole model step: the
    lease must be refreshed meanwhile, and the last load published."""
    m = make_member()
    slow = {"on": False}

    def load() -> MemberLoad:
        if slow["on"]:
            time.sleep(TTL + 1.0)  # one "step" longer than the whole lease
        return MemberLoad(queue_length=7)

    reg = await Registration.start(etcd.endpoint, m, ttl=TTL, refresh=REFRESH, load_fn=load)
    try:
        assert await watcher.wait_for(present(m.worker_id), timeout=1.0)
        slow["on"] = True
        await asyncio.sleep(2 * TTL)
        assert m.worker_id in watcher.members and reg.registrations == 1
        assert watcher.members[m.worker_id].load.queue_length == 7
    finally:
        slow["on"] = False
        await reg.stop()


async def test_a_held_up_event_loop_does_not_lose_the_lease(etcd):
    """The worker's event loop itself is held up longer than the TTL (it waits for the engine
    lock through a multi-second model step): the lease is kept alive from its own thread."""
    m = make_member()
    reg = await Registration.start(etcd.endpoint, m, ttl=TTL, refresh=REFRESH)
    try:
        time.sleep(2 * TTL)  # blocks this loop: the registration task cannot run
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
            assert await client.get(m.key) is not None
        assert reg.registrations == 1
    finally:
        await reg.stop()


async def test_stop_deletes_the_member_promptly(etcd, watcher):
    m = make_member()
    changes: list[MemberChange] = []
    watcher.add_listener(changes.append)
    reg = await Registration.start(etcd.endpoint, m, ttl=TTL, refresh=REFRESH)
    assert await watcher.wait_for(present(m.worker_id), timeout=1.0)
    t0 = time.monotonic()
    await reg.stop()
    assert await watcher.wait_for(absent(m.worker_id), timeout=1.0)
    assert time.monotonic() - t0 < 1.0
    assert changes[-1] == MemberChange("delete", m.worker_id, m)


async def test_abandoned_registration_expires_after_ttl(etcd, watcher):
    m = make_member()
    reg = await Registration.start(etcd.endpoint, m, ttl=TTL, refresh=REFRESH)
    assert await watcher.wait_for(present(m.worker_id), timeout=1.0)
    await reg.stop(revoke=False)  # like kill -9: no more refreshes, no revoke
    t0 = time.monotonic()
    assert not await watcher.wait_for(absent(m.worker_id), timeout=1.0)  # lease still live
    assert await watcher.wait_for(absent(m.worker_id), timeout=3.5)
    assert time.monotonic() - t0 < 3.5


async def test_lost_lease_is_replaced_by_a_new_one(etcd, watcher):
    m = make_member()
    reg = await Registration.start(etcd.endpoint, m, ttl=TTL, refresh=REFRESH)
    try:
        old_lease = reg.lease_id
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
            await client.revoke_lease(old_lease)
        assert await watcher.wait_for(absent(m.worker_id), timeout=1.0)
        assert await watcher.wait_for(present(m.worker_id), timeout=2.0)
        # The watcher may see the new key before the registration task resumes after its put.
        assert await eventually(lambda: reg.registrations == 2, timeout=1.0)
        assert reg.lease_id != old_lease and reg.registered
    finally:
        await reg.stop()


async def test_unreachable_etcd_neither_raises_nor_hangs():
    endpoint = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    reg = await Registration.start(endpoint, make_member(), ttl=TTL, refresh=REFRESH, timeout=1)
    watcher = await MemberWatcher.start(endpoint, timeout=1)
    await asyncio.sleep(0.5)
    assert not reg.registered and not watcher.synced and not watcher.watching
    await reg.stop()
    await watcher.stop()
    assert time.monotonic() - t0 < 5.0


async def test_etcd_restart_keeps_the_view_and_re_registers(own_etcd):
    a, load = make_member(), Counter()
    reg_a = await Registration.start(own_etcd.endpoint, a, ttl=TTL, refresh=REFRESH, load_fn=load)
    watcher = await MemberWatcher.start(own_etcd.endpoint)
    reg_b = None
    try:
        assert await watcher.wait_for(present(a.worker_id), timeout=1.0)
        own_etcd.kill()
        await asyncio.sleep(1.5)  # several failed refreshes and watch retries
        assert not watcher.watching and not reg_a.registered
        assert a.worker_id in watcher.members  # last view kept while etcd is down

        own_etcd.start()  # same ports, same data dir
        assert await eventually(lambda: reg_a.registered and watcher.watching, timeout=5.0)
        assert watcher.resyncs >= 2
        assert a.worker_id in watcher.members

        calls = load.calls  # refreshes after the restart reach the watcher
        assert await watcher.wait_for(
            lambda ms: ms[a.worker_id].load.queue_length > calls, timeout=2.0
        )
        b = make_member(role="decode")
        reg_b = await Registration.start(own_etcd.endpoint, b, ttl=TTL, refresh=REFRESH)
        assert await watcher.wait_for(present(b.worker_id), timeout=1.0)
        assert watcher.members[b.worker_id] == b
    finally:
        if reg_b is not None:
            await reg_b.stop()
        await reg_a.stop()
        await watcher.stop()


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from libkv.cluster.registry import Member, Registration

    async def main():
        m = Member(worker_id=sys.argv[2], role="prefill", model="m", address="127.0.0.1:1")
        await Registration.start(sys.argv[1], m, ttl=2, refresh=0.3)
        print("ready", flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
    """
)


async def test_member_of_another_process_appears_and_expires_after_kill_9(etcd, watcher):
    worker_id = f"child-{next(_ids)}"
    async with python_child(CHILD, etcd.endpoint, worker_id) as proc:
        assert await asyncio.wait_for(proc.stdout.readline(), 20) == b"ready\n"
        assert await watcher.wait_for(present(worker_id), timeout=1.0)
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        assert await watcher.wait_for(absent(worker_id), timeout=3.5)
