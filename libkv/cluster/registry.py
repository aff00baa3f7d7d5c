"""Cluster membership in etcd: one key per worker, held alive by that worker's lease.

Key: ``/tandem/v1/members/<role>/<worker_id>``; value: ``Member.to_json()``.

A worker runs a `Registration`: it grants a lease, puts its key under it, and every
``refresh`` seconds keeps the lease alive and re-puts the key with its current load. A worker
that dies stops refreshing, so etcd deletes its key when the TTL runs out. Routers run a
`MemberWatcher`: a range read gives the view at revision R, a watch from R+1 keeps it
current with no gap. A brief etcd outage must not stop serving (DESIGN.md), so both sides
ride it out: the registration retries and re-registers (new lease if the old one is gone),
the watcher keeps its last view and on reconnect replaces it by a fresh range read.

aetcd has no automatic keepalive and no watch resumption; both loops here supply them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from libkv.cluster.etcd_follow import Endpoints, PrefixFollower, backoff, cancel_task
from libkv.cluster.etcd_follow import EtcdConnection as _Etcd
from libkv.cluster.keepalive import LeaseKeeper

log = logging.getLogger(__name__)

MEMBERS_PREFIX = "/tandem/v1/members/"
ROLES = ("prefill", "decode", "router", "gateway")
DRAINING = "draining"  # Member.extra key: "1" while the worker finishes its work and takes none
LORAS = "loras"  # Member.extra key: the LoRA adapters a worker has loaded, comma-separated


@dataclass(frozen=True)
class MemberLoad:
    """What a worker reports each refresh so routers can weigh it."""

    queue_length: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    # Its pace, for the router's choice of where a prompt is computed (services.router.disagg):
    prefill_backlog: int = 0  # prompt tokens queued or part-computed, not yet computed
    prefill_tokens_per_s: float = 0.0  # measured prompt tokens per second of compute (0: none)
    decode_step_ms: float = 0.0  # measured time of a step of decodes alone (0: none)
    max_batched_tokens: int = 0  # most tokens one step computes (its prefill chunk)


@dataclass(frozen=True)
class Member:
    """One live worker as stored in etcd. ``incarnation`` is new at every process start."""

    worker_id: str
    role: str  # one of ROLES
    model: str
    address: str  # host:port of its gRPC server
    kv_blocks_total: int = 0
    block_size: int = 0
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    load: MemberLoad = field(default_factory=MemberLoad)
    extra: dict[str, str] = field(default_factory=dict)  # e.g. NIXL agent metadata
    tensor_parallel_size: int = 1  # ranks its model is split over (its KV layout: extra)

    @property
    def key(self) -> bytes:
        return member_key(self.role, self.worker_id)

    @property
    def draining(self) -> bool:
        """Shutting down: it finishes what it has (and serves its KV blocks) but takes nothing
        new, so routers leave it out (`MemberWatcher.members_by_role`)."""
        return self.extra.get(DRAINING) == "1"

    @property
    def loras(self) -> frozenset[str]:
        """The LoRA adapters the worker has loaded (routers send an adapter's requests only
        to workers that hold it)."""
        return frozenset(n for n in self.extra.get(LORAS, "").split(",") if n)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Member:
        """Parse; fields this version does not know are ignored (newer writers may add some)."""
        raw: dict[str, Any] = json.loads(data)
        load = _known_fields(MemberLoad, raw.get("load") or {})
        fields = _known_fields(cls, raw)
        fields["load"] = MemberLoad(**load)
        fields["extra"] = {str(k): str(v) for k, v in (raw.get("extra") or {}).items()}
        return cls(**fields)


def _known_fields(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in raw.items() if k in names}


def member_key(role: str, worker_id: str) -> bytes:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    if not worker_id or "/" in worker_id:
        raise ValueError(f"worker_id must be non-empty and contain no '/': {worker_id!r}")
    return f"{MEMBERS_PREFIX}{role}/{worker_id}".encode()


class Registration:
    """Keeps one member key alive under a lease; see the module docstring."""

    def __init__(
        self,
        endpoints: Endpoints,
        member: Member,
        ttl: int,
        refresh: float,
        load_fn: Callable[[], MemberLoad] | None,
        timeout: float,
    ) -> None:
        if refresh >= ttl:
            raise ValueError(f"refresh ({refresh} s) must be shorter than ttl ({ttl} s)")
        member_key(member.role, member.worker_id)  # validate before touching etcd
        self.member = member
        self.ttl = int(ttl)
        self.refresh = refresh
        self.load_fn = load_fn
        self.lease_id: int | None = None
        self.registered = False  # the last attempt to register or refresh succeeded
        self.registrations = 0  # how many times a lease was granted and the key put
        self._etcd = _Etcd(endpoints, timeout, "register")
        self._task: asyncio.Task[None] | None = None
        self._keeper: LeaseKeeper | None = None
        self._draining = False  # every later put carries the draining mark (see drain)
        self._extra_overrides: dict[str, str] = {}  # set_extra fields, kept at every put

    @classmethod
    async def start(
        cls,
        endpoints: Endpoints,
        member: Member,
        ttl: int = 10,
        refresh: float = 3.0,
        load_fn: Callable[[], MemberLoad] | None = None,
        timeout: float = 2.0,
    ) -> Registration:
        """Register now if etcd answers, and keep the registration alive in a task.

        Does not raise when etcd is unreachable: the task keeps trying (check `registered`).
        """
        self = cls(endpoints, member, ttl, refresh, load_fn, timeout)
        try:
            await self._register()
        except Exception as e:
            log.warning("registering %s failed, will retry: %r", member.worker_id, e)
            await self._etcd.reset()
        self._task = asyncio.create_task(self._run(), name=f"registration-{member.worker_id}")
        # The lease also stays alive while this event loop is held up (see libkv.cluster.keepalive).
        self._keeper = LeaseKeeper(
            endpoints, timeout, refresh, lambda: self.lease_id, member.worker_id
        ).start()
        return self

    def _current(self) -> Member:
        if self.load_fn is not None:
            try:
                self.member = dataclasses.replace(self.member, load=self.load_fn())
            except Exception:
                log.exception("load_fn failed; keeping the last load")
        return self.member

    async def _current_soon(self) -> Member:
        """``_current()`` in a thread, waited for at most half a refresh: a worker's load
        function takes the engine's lock, held for a whole model step, and neither this event
        loop nor the lease may wait behind a slow step (the lease would lapse and a live worker
        drop out of the member view). Meanwhile the last load is published."""
        if self.load_fn is None:
            return self.member
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._current), self.refresh / 2)
        except TimeoutError:
            return self.member

    async def _register(self) -> None:
        """Grant a new lease and put the key under it."""
        self.registered = False
        lease = await self._etcd.client.lease(self.ttl)
        self.lease_id = lease.id
        member = self._published(await self._current_soon())
        await self._etcd.client.put(member.key, member.to_json(), lease=lease.id)
        self.registered = True
        self.registrations += 1
        log.info("registered %s under lease %x", self.member.worker_id, lease.id)

    async def _refresh_once(self) -> None:
        if self.lease_id is None:
            await self._register()
            return
        reply = await self._etcd.client.refresh_lease(self.lease_id)
        if reply is None or reply.TTL <= 0:  # etcd answers TTL 0 for an unknown lease
            log.warning(
                "lease %x of %s is gone; re-registering", self.lease_id, self.member.worker_id
            )
            self.lease_id = None
            await self._register()
            return
        member = self._published(await self._current_soon())
        await self._etcd.client.put(member.key, member.to_json(), lease=self.lease_id)
        self.registered = True

    async def _run(self) -> None:
        failures = 0 if self.registered else 1
        while True:
            try:
                pause = self.refresh if failures == 0 else backoff(failures, self.refresh)
                await asyncio.sleep(pause)
                await self._refresh_once()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures += 1
                self.registered = False
                log.warning("refreshing %s failed (%d): %r", self.member.worker_id, failures, e)
                await self._etcd.reset()

    async def publish(self) -> None:
        """Put the member record now (after `set_extra`), instead of at the next refresh."""
        if self.lease_id is None:
            return
        member = self._published(self.member)
        await self._etcd.client.put(member.key, member.to_json(), lease=self.lease_id)

    def set_extra(self, key: str, value: str) -> None:
        """Change one field of the member record; published at the next refresh (within
        ``refresh`` seconds)."""
        extra = {**self.member.extra, key: value}
        self.member = dataclasses.replace(self.member, extra=extra)
        self._extra_overrides[key] = value

    def _published(self, member: Member) -> Member:
        """``member`` as put in etcd: with the `set_extra` fields, and marked draining once
        `drain` was called. Applied at each put, since the load thread (``_current``) may write
        back a member read before."""
        extra = {**member.extra, **self._extra_overrides}
        if self._draining:
            extra[DRAINING] = "1"
        if extra == member.extra:
            return member
        return dataclasses.replace(member, extra=extra)

    async def drain(self) -> None:
        """Mark the member draining and put it now (later refreshes keep the mark). The key
        stays until `stop`, so peers still find the worker, e.g. its NIXL agent, meanwhile."""
        self._draining = True
        if self.lease_id is None:
            return  # not registered right now: the next registration carries the mark
        member = self._published(self.member)
        try:
            await asyncio.wait_for(
                self._etcd.client.put(member.key, member.to_json(), lease=self.lease_id),
                self._etcd.timeout,
            )
        except Exception as e:
            log.warning("marking %s draining failed: %r", self.member.worker_id, e)

    async def undrain(self) -> None:
        """Take work again after `drain` (a role switch that could not finish its drain):
        the mark is dropped and the record put now."""
        self._draining = False
        if self.lease_id is not None:
            member = self._published(self.member)
            extra = {k: v for k, v in member.extra.items() if k != DRAINING}
            member = dataclasses.replace(member, extra=extra)
            await self._etcd.client.put(member.key, member.to_json(), lease=self.lease_id)

    async def stop(self, revoke: bool = True) -> None:
        """Stop refreshing and revoke the lease, which deletes the key at once.

        ``revoke=False`` leaves the key to expire with its TTL, as a crashed process would.
        Never hangs on an unreachable etcd: each call is bounded by ``timeout``.
        """
        if self._keeper is not None:
            self._keeper.stop()
        await cancel_task(self._task)
        self._task = None
        if revoke and self.lease_id is not None:
            try:
                await asyncio.wait_for(
                    self._etcd.client.revoke_lease(self.lease_id), self._etcd.timeout
                )
            except Exception as e:
                log.warning("revoking the lease of %s failed: %r", self.member.worker_id, e)
        self.lease_id = None
        self.registered = False
        await self._etcd.close()


class MemberChange(NamedTuple):
    """One change of a watcher's view, given to listeners."""

    kind: Literal["put", "delete"]
    worker_id: str
    member: Member | None  # the new member for "put", the removed one for "delete"


class MemberDirectory(Protocol):
    """The read side routers need; `MemberWatcher` implements it from etcd."""

    def members_by_role(self, role: str) -> list[Member]: ...


class ModelDirectory:
    """The members of one base model (``Member.model``) in a directory of many: each model's
    routing (KV-aware choice, load, admission) sees only its own workers."""

    def __init__(self, directory: MemberDirectory, model: str) -> None:
        self.directory, self.model = directory, model

    def members_by_role(self, role: str) -> list[Member]:
        return [m for m in self.directory.members_by_role(role) if m.model == self.model]


class MemberWatcher:
    """A live local view of all members, kept by a `PrefixFollower`; see module doc."""

    def __init__(self, endpoints: Endpoints, prefix: str, timeout: float) -> None:
        self.prefix = prefix.encode()
        self.members: dict[str, Member] = {}
        self._keys: dict[bytes, str] = {}  # etcd key -> worker_id
        self._listeners: list[Callable[[MemberChange], None]] = []
        self._changed = asyncio.Condition()
        self._follower = PrefixFollower(endpoints, self.prefix, self, timeout, self._notify)

    @classmethod
    async def start(
        cls, endpoints: Endpoints, prefix: str = MEMBERS_PREFIX, timeout: float = 2.0
    ) -> MemberWatcher:
        """Read the current members (if etcd answers) and follow changes in a task."""
        self = cls(endpoints, prefix, timeout)
        await self._follower.start()
        return self

    @property
    def revision(self) -> int:
        """etcd revision the view reflects."""
        return self._follower.revision

    @property
    def synced(self) -> bool:
        """A range read has succeeded at least once."""
        return self._follower.synced

    @property
    def watching(self) -> bool:
        """A watch is established right now."""
        return self._follower.watching

    @property
    def resyncs(self) -> int:
        """Range reads done (1 after a clean start)."""
        return self._follower.resyncs

    def members_by_role(self, role: str) -> list[Member]:
        """Members of ``role`` that take new work, by id (draining ones are only in `members`)."""
        ms = (m for m in self.members.values() if m.role == role and not m.draining)
        return sorted(ms, key=_by_id)

    def add_listener(self, callback: Callable[[MemberChange], None]) -> None:
        """Call ``callback`` (synchronously, in the event loop) on every change of the view."""
        self._listeners.append(callback)

    async def wait_for(
        self, predicate: Callable[[dict[str, Member]], bool], timeout: float
    ) -> bool:
        """Wait until ``predicate(members)`` holds; False if it still does not after timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: predicate(self.members)), timeout
                )
            except TimeoutError:
                return False
        return True

    # -- FollowerSink -------------------------------------------------------------------------
    def reset(self, items: list[tuple[bytes, bytes]]) -> None:
        """Replace the view with what etcd holds now (drops members that expired meanwhile)."""
        fresh: dict[bytes, Member] = {}
        for key, value in items:
            member = _parse(key, value)
            if member is not None:
                fresh[key] = member
        for key in [k for k in self._keys if k not in fresh]:
            self._remove(key)
        for key, member in fresh.items():
            self._upsert(key, member)

    def put(self, key: bytes, value: bytes) -> None:
        member = _parse(key, value)
        if member is not None:
            self._upsert(key, member)

    def delete(self, key: bytes) -> None:
        self._remove(key)

    def _upsert(self, key: bytes, member: Member) -> None:
        if self.members.get(member.worker_id) == member and self._keys.get(key):
            return
        self._keys[key] = member.worker_id
        self.members[member.worker_id] = member
        self._emit(MemberChange("put", member.worker_id, member))

    def _remove(self, key: bytes) -> None:
        worker_id = self._keys.pop(key, None)
        if worker_id is None or worker_id in self._keys.values():
            return  # unknown key, or the worker id lives on under another key
        member = self.members.pop(worker_id, None)
        self._emit(MemberChange("delete", worker_id, member))

    def _emit(self, change: MemberChange) -> None:
        for callback in self._listeners:
            try:
                callback(change)
            except Exception:
                log.exception("member listener failed on %s", change)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def stop(self) -> None:
        await self._follower.stop()


def _by_id(member: Member) -> str:
    return member.worker_id


def _parse(key: bytes, value: bytes) -> Member | None:
    try:
        return Member.from_json(value)
    except Exception as e:
        log.warning("ignoring unreadable member value at %r: %r", key, e)
        return None
