"""The engine core's loop: commands applied between steps, one message out per step.

One thread owns the ``LLMEngine``: it applies every queued command (adds, aborts, calls) before
each step, steps while there is work, and sends what the step produced as one `StepMessage`
(deltas of every request, prefix-cache events, step stats). Nothing else touches the engine, so
no lock is held across a step and the client's event loop never waits on one. Whether the loop
runs in its own process (a worker's engine core, ``engine.core.process``) or on a thread of the
caller (``engine.core.client.EngineClient.local``) only changes how messages travel.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.core.messages import (
    Add,
    Call,
    Delta,
    Failure,
    Handoff,
    Listen,
    RankCall,
    Reply,
    Snapshot,
    StepMessage,
    Stop,
)
from engine.errors import RequestNotFoundError
from libkv.block_pool import IntegrityError

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine, RequestOutput
    from libkv.hashing import BlockHash

log = logging.getLogger(__name__)
SNAPSHOT_EVERY_S = 0.02  # a busy loop sends the engine's counters at most this often
IDLE_WAIT_S = 0.05


def _abort(engine: LLMEngine, request_id: str) -> bool:
    try:
        engine.abort(request_id)
    except RequestNotFoundError:
        return False
    return True


def _worker_stats(engine: LLMEngine) -> tuple[Any, int, bool]:
    """(EngineStats, held requests, whether the block bookkeeping is intact)."""
    try:
        engine.check_integrity()
        ok = True
    except IntegrityError:
        ok = False
    return engine.stats(), engine.handoff.num_held, ok


# The engine methods a client may call (`Call.method`), each run between two steps (the KV
# hand-off's run on the engine's ``handoff`` part, ``engine.handoff.Handoff``).
CALLS: dict[str, Callable[..., Any]] = {
    "abort": _abort,
    "add_prefilled": lambda e, *a, **k: e.handoff.add_prefilled(*a, **k),
    "reserve": lambda e, *a: e.handoff.reserve(*a),
    "release": lambda e, rid: e.handoff.release(rid),
    "hold_for_move": lambda e, rid: e.handoff.hold_for_move(rid),
    "handoff_checksums": lambda e, ids: e.handoff.handoff_checksums(ids),
    "block_checksums": lambda e, ids, algorithm=None: e.handoff.block_checksums(ids, algorithm),
    "read_blocks": lambda e, ids: e.handoff.read_blocks(ids),
    "write_blocks": lambda e, ids, data: e.handoff.write_blocks(ids, data),
    "add_lora": lambda e, name, path: e.add_lora(name, path) and None,
    "remove_lora": lambda e, name: e.remove_lora(name),
    "list_loras": lambda e: e.list_loras(),
    "embed": lambda e, ids, lora=None: e.embed(ids, lora).tolist(),
    "prompt_logprobs": lambda e, ids, k, lora=None: e.prompt_logprobs(ids, k, lora),
    "worker_stats": _worker_stats,
}


class CacheEvents:
    """A ``libkv.kv_manager.CacheListener`` that keeps the events for the next message (it is
    called on the loop's thread, inside the engine's calls)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def cached(self, index: int, block_hash: BlockHash, parent: BlockHash) -> None:
        self.events.append(("cached", index, block_hash, parent))

    def evicted(self, block_hash: BlockHash) -> None:
        self.events.append(("evicted", block_hash))

    def take(self) -> list[tuple]:
        out, self.events = self.events, []
        return out


class TierEvents:
    """The host tier's ``libkv.host_tier.TierListener``: its events join the prefix cache's,
    tagged ``host_cached`` / ``host_evicted``."""

    def __init__(self, cache: CacheEvents) -> None:
        self.cache = cache  # (its list is replaced on each take)

    def cached(self, index: int, block_hash: BlockHash, parent: BlockHash) -> None:
        self.cache.events.append(("host_cached", index, block_hash, parent))

    def evicted(self, block_hash: BlockHash) -> None:
        self.cache.events.append(("host_evicted", block_hash))


class EngineLoop:
    """Drives one engine from one thread. ``send`` delivers each outgoing message (it may be
    called from another thread too: a tensor-parallel rank's reply, so it must be
    thread-safe); ``submit`` queues a command from any thread."""

    def __init__(self, engine: LLMEngine, send: Callable[[object], None]) -> None:
        self.engine = engine
        self.send = send
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stopped = False
        self._events: CacheEvents | None = None
        self._steps: list[Any] = []
        self._live: set[str] = set()  # requests with a stream open at the client
        self._prefills: dict[str, tuple[int, bool]] = {}  # hold_kv request -> (n, sums)
        self._last_snapshot = 0.0
        self.steps = 0
        engine.on_step = self._steps.append

    def submit(self, command: object) -> None:
        self._inbox.append(command)
        self._wake.set()

    def run(self) -> None:
        """Until `Stop`: commands, then a step when there is work, else wait for a command."""
        while not self._stopped:
            self._apply()
            if self._stopped:
                break
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - fail every request, keep serving
                    log.exception("engine step failed")
                    self._fail(exc)
                    continue
                self.steps += 1
                self._send_step(outputs)
                self._hold()
            else:
                self._flush_idle()
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()

    def _hold(self) -> None:
        """With late planning (``engine.late_planning``), wait for a command until the step in
        flight nearly ends before planning the next: a request arriving meanwhile joins it."""
        if self._inbox:
            return
        self._wake.clear()
        if self._inbox:  # (one queued between the check and the clear is seen here)
            return
        try:
            self.engine.hold_planning(self._wake)
        except Exception:  # noqa: BLE001 - plan at once; the step reports a device's failure
            log.exception("late planning's wait failed")

    # -- commands -----------------------------------------------------------------------------
    def _apply(self) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            try:
                self._handle(command)
            except Exception:  # noqa: BLE001 - one bad command must not stop the loop
                log.exception("engine command %s failed", type(command).__name__)

    def _handle(self, command: object) -> None:
        if isinstance(command, Add):
            self._add(command)
        elif isinstance(command, Call):
            self._call(command)
        elif isinstance(command, RankCall):
            self._rank_call(command)
        elif isinstance(command, Listen):
            self._events = CacheEvents() if command.on else None
            self.engine.kv.set_listener(self._events)
            tier = getattr(self.engine.kv, "tier", None)  # the host tier, if any
            if tier is not None:
                tier.listener = TierEvents(self._events) if self._events else None
        elif isinstance(command, Stop):
            self._stopped = True
        else:
            raise TypeError(f"unknown engine command {command!r}")

    def _add(self, c: Add) -> None:
        try:
            self.engine.add_request(
                c.request_id, c.prompt, c.params, tenant=c.tenant, hold_kv=c.hold_kv,
                priority=c.priority, lora=c.lora,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            self.send(Reply(c.call_id, False, exc))
            return
        self._live.add(c.request_id)
        if c.hold_kv:
            self._prefills[c.request_id] = (c.params.n, c.handoff_sums)
        self.send(Reply(c.call_id, True))

    def _call(self, c: Call) -> None:
        try:
            value = CALLS[c.method](self.engine, *c.args, **c.kwargs)
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            self.send(Reply(c.call_id, False, exc))
            return
        if c.method == "add_prefilled":
            self._live.add(c.args[0])
        elif c.method in ("abort", "hold_for_move") and value:
            self._forget(c.args[0])
        self.send(Reply(c.call_id, True, value))

    def _rank_call(self, c: RankCall) -> None:
        ranks = self.engine.ranks
        if ranks is None:
            self.send(Reply(c.call_id, False, RuntimeError("the engine has no other ranks")))
            return

        def done(fut: Any) -> None:
            exc = fut.exception()
            self.send(Reply(c.call_id, exc is None, exc if exc is not None else fut.result()))

        ranks.call(c.rank, c.fn, *c.args).add_done_callback(done)

    def _forget(self, request_id: str) -> None:
        self._live.discard(request_id)
        self._prefills.pop(request_id, None)

    # -- messages -----------------------------------------------------------------------------
    def _send_step(self, outputs: list[RequestOutput]) -> None:
        deltas = [_delta(o) for o in outputs]
        last: dict[str, Delta] = {}
        for d in deltas:
            last[d.request_id] = d
        for rid, d in last.items():
            if d.others_pending:
                continue
            prefill = self._prefills.pop(rid, None)
            if prefill is not None and any(x.kv_held for x in deltas if x.request_id == rid):
                d.handoff = self._handoff(rid, *prefill)
            self._live.discard(rid)
        msg = StepMessage(deltas, self._take_events(), self._steps[:])
        self._steps.clear()
        now = time.monotonic()
        if now - self._last_snapshot >= SNAPSHOT_EVERY_S:
            msg.snapshot = self._snapshot(now)
        self.send(msg)

    def _handoff(self, request_id: str, n: int, sums: bool) -> Handoff:
        """Where a prefill's KV is held, read before the client can release it."""
        e, h = self.engine, self.engine.handoff
        block_ids = h.held_block_ids(request_id)
        checksums = h.handoff_checksums(block_ids) if sums else []
        return Handoff(
            tuple(block_ids),
            tuple(checksums),
            e.runner.checksum_algorithm if checksums else "",
            tuple(h.generator_state(request_id, i) for i in range(n)),
        )

    def _take_events(self) -> list[tuple]:
        return self._events.take() if self._events is not None else []

    def _snapshot(self, now: float) -> Snapshot:
        self._last_snapshot = now
        return Snapshot(self.engine.stats(), self.engine.handoff.num_held)

    def _flush_idle(self) -> None:
        """While idle: what calls changed since the last message (evictions, counters)."""
        events = self._take_events()
        now = time.monotonic()
        if events or self._steps or now - self._last_snapshot >= 10 * SNAPSHOT_EVERY_S:
            self.send(StepMessage([], events, self._steps[:], self._snapshot(now)))
            self._steps.clear()

    def _fail(self, exc: BaseException) -> None:
        for rid in list(self._live):
            _abort(self.engine, rid)
            self._forget(rid)
        self.send(Failure(f"engine step failed: {exc}"))


def _delta(o: RequestOutput) -> Delta:
    return Delta(
        o.request_id, o.index, o.new_token_ids, o.new_text, o.new_logprobs, o.finish_reason,
        o.stop_reason, o.num_cached_tokens, o.kv_held, o.others_pending,
    )  # fmt: skip
