"""Routing policies (no grpc): which prefill and decode worker serve a request.

``kv`` (the default) scores every live worker by the prompt blocks it already caches (from the
block-location index, on the shared tenant-salted hash chain) against its load, separately for
the prefill choice and the decode choice. Whether the prompt's *uncached* part is computed on
the prefill worker (and handed over) or on the decode worker is predicted per request against
its SLOs (`services.router.disagg`), for every policy. Costs are in prompt blocks::

    cost(w) = miss_weight * miss(w)              miss = prompt blocks w does not cache
            + load_weight * load(w) * work(w)      load = requests queued + running
            + a penalty when w has too few free KV blocks for the request (as w last
              reported them, corrected by this router's requests that ended or started since)

``miss_weight`` is 1 where the worker computes the missing part (prefill, decode-only) and
``TRANSFER_WEIGHT`` for a disaggregated decode worker, which only receives the blocks it lacks.
``work(w)`` is what the load delays: where w computes, the blocks it computes (``miss``, at
least 1), so a few requests in flight never outweigh a large cached prefix (a worker holding
28 of 40 blocks loses to an idle one at 5 requests in flight; it did at 2 when the load
weighed the whole prompt); on a disaggregated decode worker, the whole prompt (it decodes the
whole request, and hand-offs spread by load).
``load(w)`` is the requests this router has in flight on w now plus those of other routers as
w last reported them in etcd (the report, up to one member refresh old, less this router's own
in flight when it arrived: a stale report would otherwise still count a conversation's previous
turn against the worker that caches it). Ties go to the lower worker id, so replicas with the
same etcd view choose alike (under load each one also weighs the requests it has in flight
itself, which the others learn at w's next load report).

``least-loaded``: fewest requests, then least KV in use. ``round-robin``: each role in turn.
``session``: the same session key (OpenAI ``user``) always lands on the same workers while
they live (rendezvous hashing), least-loaded without a key. Every plan carries a reason
(``kv-hit``, ``load``, ``decode-only``, ``round-robin``, ``session``) that the router counts per
policy, and the disaggregation decision with its own reason (`services.router.disagg`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from libkv.cluster.registry import Member, MemberChange, MemberDirectory, MemberLoad
from libkv.cluster.tiers import tier_cached_blocks, tier_depths
from libkv.hashing import BlockHash, encode_extra_keys, hash_prefix_blocks
from libkv.kv_layout import pair_refusal
from libkv.transfer import handoff_path
from services.router.disagg import DISAGG, Decision, Disaggregator, Slo

log = logging.getLogger(__name__)

POLICIES = ("kv", "least-loaded", "round-robin", "session")
TRANSFER_WEIGHT = 0.25  # a block moved to a decode worker, relative to a block computed
FULL_PENALTY = 1000.0  # per prompt block, for a worker without room for the request
DEFAULT_BLOCK_SIZE = 16


class LocationLookup(Protocol):
    """The read side of the block-location index (``libkv.cluster.summary_index.SummaryIndex``)."""

    def match(self, hashes: Sequence[BlockHash]) -> Mapping[tuple[str, str], int]: ...


class RouteMemory(LocationLookup, Protocol):
    """An index that also remembers where this router just sent prompts
    (``libkv.cluster.recent_routes.HintedIndex``), until the workers' summaries show them."""

    def note(self, holders: Sequence[tuple[str, str]], hashes: Sequence[BlockHash]) -> None: ...


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy looks at."""

    prompt: Sequence[int]
    tenant: str = ""
    session: str = ""
    max_tokens: int = 16  # completion tokens of all choices as admission books them
    lora: str = ""  # LoRA adapter: only workers that hold it serve the request
    slo_ttft_ms: float = 0.0  # the request's objectives (0: the router's defaults)
    slo_tpot_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    """Where one request runs: ``prefill`` None means decode-only."""

    decode: Member
    prefill: Member | None
    reason: str
    cached_blocks: float = 0  # blocks the computing worker is expected to hold (host: less)
    uncached: int = 0  # prompt tokens the computing worker computes
    decision: Decision | None = None  # disagg or decode-only, and why


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    name: str = "kv"
    decode_only_threshold: int = 256  # the cold-start rule of `services.router.disagg`
    load_weight: float = 0.5
    slo_ttft_ms: float = 1000.0  # objectives of a request that carries none
    slo_tpot_ms: float = 50.0
    disagg_mode: str = "slo"  # `services.router.disagg.MODES`

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; one of {', '.join(POLICIES)}")


class _Chain:
    """The request's hash chain per block size, computed on first use."""

    def __init__(self, req: RouteRequest, index: LocationLookup | None) -> None:
        self.req, self.index = req, index
        self._depths: dict[int, Mapping[tuple[str, str], int]] = {}

        self._hashes: dict[int, list[BlockHash]] = {}

    def hashes(self, block_size: int) -> list[BlockHash]:
        if block_size not in self._hashes:
            extra = encode_extra_keys(self.req.tenant or None, self.req.lora or None)
            self._hashes[block_size] = hash_prefix_blocks(self.req.prompt, block_size, extra)
        return self._hashes[block_size]

    def cached_blocks(self, m: Member) -> float:
        """Prompt blocks ``m`` holds, a host-tier hit weighed below a device hit
        (``libkv.cluster.tiers``)."""
        if self.index is None:
            return 0
        bs = m.block_size or DEFAULT_BLOCK_SIZE
        if bs not in self._depths:
            self._depths[bs] = self.index.match(self.hashes(bs))
        gpu, host = tier_depths(self._depths[bs], m.worker_id, m.incarnation)
        return tier_cached_blocks(gpu, host)

    def remember(self, *members: Member | None) -> None:
        """Tell a `RouteMemory` index that ``members`` will cache this prompt."""
        note = getattr(self.index, "note", None)
        if note is None:
            return
        by_size: dict[int, list[tuple[str, str]]] = {}
        for m in members:
            if m is not None:
                holders = by_size.setdefault(m.block_size or DEFAULT_BLOCK_SIZE, [])
                holders.append((m.worker_id, m.incarnation))
        for bs, holders in by_size.items():
            note(holders, self.hashes(bs))


class Chooser:
    """Applies one policy to the live members of a `MemberDirectory`."""

    def __init__(
        self,
        directory: MemberDirectory,
        config: PolicyConfig,
        index: LocationLookup | None = None,
        inflight: Counter[str] | None = None,
    ) -> None:
        self.directory = directory
        self.config = config
        self.index = index
        self.inflight: Counter[str] = inflight if inflight is not None else Counter()
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}
        self.inflight_blocks: Counter[str] = Counter()  # KV blocks of those requests
        # worker -> (its last load report, this router's requests and their blocks on it then)
        self._own_at_report: dict[str, tuple[MemberLoad, int, int]] = {}
        slo = Slo(config.slo_ttft_ms / 1000, config.slo_tpot_ms / 1000)
        self.disagg = Disaggregator(slo, config.decode_only_threshold, config.disagg_mode)

    def live(self, role: str, exclude: set[str], lora: str = "") -> list[Member]:
        """Members of ``role`` that take work, not in ``exclude``; with ``lora``, only those
        whose record lists that adapter as loaded."""
        members = self.directory.members_by_role(role)
        return [m for m in members if m.worker_id not in exclude and (not lora or lora in m.loras)]

    def prefill_for(
        self, decoders: list[Member], exclude: set[str], lora: str = ""
    ) -> list[Member]:
        """Live prefill workers that can hand KV to at least one of ``decoders`` over a
        GPU-direct path (or between host-memory pools): `libkv.transfer.handoff_path`."""
        live = self.live("prefill", exclude, lora)
        return [p for p in live if any(paired(p, d) for d in decoders)]

    def pick_embedder(self, lora: str, exclude: set[str]) -> Member | None:
        """The least loaded prefill worker holding ``lora`` (embedding is prefill-only work);
        a decode worker when no prefill worker is live."""
        candidates = self.live("prefill", exclude, lora) or self.live("decode", exclude, lora)
        return min(candidates, key=self._least_loaded) if candidates else None

    @contextlib.contextmanager
    def working(self, m: Member, tokens: int) -> Iterator[None]:
        """Count a request on ``m`` while a call to it runs (``load``), and the KV blocks its
        ``tokens`` take (``free_blocks``)."""
        blocks = -(-tokens // (m.block_size or DEFAULT_BLOCK_SIZE))
        self.inflight[m.worker_id] += 1
        self.inflight_blocks[m.worker_id] += blocks
        try:
            yield
        finally:
            self.inflight[m.worker_id] -= 1
            self.inflight_blocks[m.worker_id] -= blocks

    def observe(self, change: MemberChange) -> None:
        """A `MemberWatcher` listener: note this router's own requests in flight on a worker
        when its load report arrives, so `load` and `free_blocks` can tell what changed since
        from what other routers' requests hold."""
        self.disagg.backlogs.observe(change)
        w = change.worker_id
        if change.kind == "put" and change.member is not None:
            self._own_at_report[w] = (change.member.load, self.inflight[w],
                                      self.inflight_blocks[w])  # fmt: skip
        else:
            self._own_at_report.pop(w, None)

    def _observed(self, m: Member) -> tuple[MemberLoad, int, int] | None:
        seen = self._own_at_report.get(m.worker_id)
        return seen if seen is not None and seen[0] is m.load else None

    def load(self, m: Member) -> int:
        """Requests queued or running on ``m``: this router's in flight now, plus those of
        other routers as ``m`` last reported them (its report less this router's own in flight
        when it arrived). A report is up to one member refresh old: it still counts requests
        that finished since (in a conversation, the previous turn of the one being routed, on
        the worker that caches it), which this router's own count does not. A report that
        arrived unobserved (no `observe` listener) counts as it is, the larger of the two."""
        own = self.inflight[m.worker_id]
        reported = m.load.queue_length + m.load.running
        seen = self._observed(m)
        if seen is None:
            return max(own, reported)
        return own + max(reported - seen[1], 0)

    def free_blocks(self, m: Member) -> int:
        """KV blocks free on ``m`` as last reported, corrected (when the report was observed)
        by the blocks of this router's requests that ended since (their blocks are free again,
        if still cached) and that started since."""
        seen = self._observed(m)
        if seen is None:
            return m.load.kv_blocks_free
        return m.load.kv_blocks_free + seen[2] - self.inflight_blocks[m.worker_id]

    # -- plans ----------------------------------------------------------------------------------
    def plan(self, req: RouteRequest, exclude: set[str]) -> Plan | None:
        """Workers for ``req`` avoiding ``exclude``; None when no decode worker is live."""
        decoders = self.live("decode", exclude, req.lora)
        if not decoders:
            return None
        if self.config.name == "kv":
            return self._plan_kv(req, decoders, exclude)
        decode = self._pick(req, decoders, "decode")
        prefill = self.pick_prefill(req, exclude, decode)
        n = len(req.prompt)
        decision = self._decide(req, (prefill, n) if prefill else None, decode, (decode, n))
        if decision.choice != DISAGG or prefill is None:
            return Plan(decode, None, "decode-only", 0, n, decision)
        reason = {"least-loaded": "load", "round-robin": "round-robin"}.get(self.config.name)
        reason = reason or ("session" if req.session else "load")
        return Plan(decode, prefill, reason, 0, n, decision)

    def _decide(
        self,
        req: RouteRequest,
        prefill: tuple[Member, int] | None,
        decode_recv: Member | None,
        decode_local: tuple[Member, int],
    ) -> Decision:
        peers = [*self.directory.members_by_role("prefill"),
                 *self.directory.members_by_role("decode")]  # fmt: skip
        slo = self.disagg.slo(req.slo_ttft_ms, req.slo_tpot_ms)
        return self.disagg.decide(slo, req.max_tokens, prefill, decode_recv, decode_local, peers)

    def pick_prefill(
        self, req: RouteRequest, exclude: set[str], decode: Member | None = None
    ) -> Member | None:
        """The prefill worker for ``req`` under this policy (also for a retry); with
        ``decode``, only one that can hand KV to it."""
        candidates = self.live("prefill", exclude, req.lora)
        if decode is not None:
            candidates = [p for p in candidates if paired(p, decode)]
        if not candidates:
            return None
        if self.config.name == "kv":
            chain = _Chain(req, self.index)
            best = min(candidates, key=lambda m: self._cost(req, chain, m))
            chain.remember(best)
            return best
        return self._pick(req, candidates, "prefill")

    def _plan_kv(self, req: RouteRequest, decoders: list[Member], exclude: set[str]) -> Plan:
        """The cheapest decode worker to compute the prompt itself, the cheapest prefill worker
        with the cheapest decode worker to receive from it, and the disagg decision between
        the two (`_decide`)."""
        chain = _Chain(req, self.index)
        local = min(decoders, key=lambda m: self._cost(req, chain, m))
        local_hit = chain.cached_blocks(local)
        uncached_d = self._uncached(req, local, local_hit)
        candidates = self.prefill_for(decoders, exclude, req.lora)
        prefill = min(candidates, key=lambda m: self._cost(req, chain, m)) if candidates else None
        receiver, option = None, None
        if prefill is not None:
            paired_decoders = [d for d in decoders if paired(prefill, d)]
            receiver = min(paired_decoders, key=lambda m: self._cost(req, chain, m, receives=True))
            option = (prefill, self._uncached(req, prefill, chain.cached_blocks(prefill)))
        decision = self._decide(req, option, receiver, (local, uncached_d))
        if decision.choice != DISAGG or prefill is None or option is None or receiver is None:
            chain.remember(local)
            return Plan(local, None, "decode-only", local_hit, uncached_d, decision)
        hit = chain.cached_blocks(prefill)
        chain.remember(prefill, receiver)  # the decode worker caches the blocks it receives
        return Plan(receiver, prefill, "kv-hit" if hit else "load", hit, option[1], decision)

    @staticmethod
    def _uncached(req: RouteRequest, m: Member, hit_blocks: float) -> int:
        """Prompt tokens ``m`` computes, holding ``hit_blocks`` of them (the last one always;
        host-tier blocks count as part of one, `libkv.cluster.tiers`)."""
        held = int(hit_blocks * (m.block_size or DEFAULT_BLOCK_SIZE))
        return max(len(req.prompt) - held, 1)

    # -- scoring ----------------------------------------------------------------------------------
    def _cost(
        self, req: RouteRequest, chain: _Chain, m: Member, receives: bool = False
    ) -> tuple[float, str]:
        """The module docstring's cost of ``m`` computing the request's uncached part (or,
        ``receives``, decoding it from KV handed over)."""
        bs = m.block_size or DEFAULT_BLOCK_SIZE
        blocks = -(-len(req.prompt) // bs)
        miss = blocks - min(chain.cached_blocks(m), blocks)
        # The load delays what w has to do for this request: the blocks it computes (at least
        # one: the last token is always computed), or, receiving the KV, the whole request.
        miss_weight, work = (TRANSFER_WEIGHT, blocks) if receives else (1.0, max(miss, 1))
        cost = miss_weight * miss + self.config.load_weight * self.load(m) * work
        need = miss + -(-req.max_tokens // bs)
        reported = m.load.kv_blocks_free + m.load.kv_blocks_used > 0  # a load report arrived
        if reported and self.free_blocks(m) < need:
            cost += FULL_PENALTY * blocks
        return (cost, m.worker_id)

    def _pick(self, req: RouteRequest, candidates: list[Member], role: str) -> Member:
        name = self.config.name
        if name == "round-robin":
            return candidates[next(self._turn[role]) % len(candidates)]
        if name == "session" and req.session:
            return max(candidates, key=_rendezvous(req.session))
        return min(candidates, key=self._least_loaded)

    def _least_loaded(self, m: Member) -> tuple[float, float, str]:
        total = max(m.kv_blocks_total, 1)
        queued = self.inflight[m.worker_id] + m.load.queue_length
        return (queued, m.load.kv_blocks_used / total, m.worker_id)


def paired(prefill: Member, decode: Member) -> bool:
    """Whether KV can move from ``prefill`` to ``decode``: their KV layouts agree (any two
    tensor-parallel sizes do; a different geometry never pairs, so blocks are never
    mis-sliced: `libkv.kv_layout.pair_refusal`), and no GPU memory would cross a host or TCP
    path (`libkv.transfer.handoff_path`)."""
    why = pair_refusal(prefill.extra, decode.extra)
    if why is not None:
        _refuse_once(
            f"not pairing prefill {prefill.worker_id} (tp {prefill.tensor_parallel_size}) with "
            f"decode {decode.worker_id} (tp {decode.tensor_parallel_size}): {why}; their "
            "requests are served decode-only"
        )
        return False
    return handoff_path(prefill.extra, decode.extra) is not None


@functools.lru_cache(maxsize=1024)
def _refuse_once(reason: str) -> None:
    """Log a refused pair once (per reason) rather than at every request."""
    log.warning("%s", reason)


def _rendezvous(session: str) -> Callable[[Member], bytes]:
    """Highest-random-weight key: stable per (session, worker), so only the sessions of a
    worker that leaves move, and every router replica agrees."""

    def weight(m: Member) -> bytes:
        return hashlib.sha256(f"{session}\x00{m.worker_id}".encode()).digest()

    return weight
