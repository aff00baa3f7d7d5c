"""Routing policies (no grpc): which prefill and decode worker serve a request.

``kv`` (the default) scores every live worker by the prompt blocks it already caches (from the
block-location index, on the shared tenant-salted hash chain) against its load, separately for
the prefill choice and the decode choice, with conditional disaggregation on the *uncached*
part: when the best decode worker would have to compute fewer than ``decode_only_threshold``
prompt tokens itself, the request goes decode-only to it. Costs are in prompt blocks::

    cost(w) = miss_weight * (prompt blocks w does not cache)
            + load_weight * load(w) * (prompt blocks)         load = requests queued + running
            + a penalty when w reports too few free KV blocks for the request

``miss_weight`` is 1 where the worker computes the missing part (prefill, decode-only) and
``TRANSFER_WEIGHT`` for a disaggregated decode worker, which only receives the blocks it lacks.
``load(w)`` is the larger of the requests this router has in flight on w (current) and those
w last reported in etcd (every router's, up to one member refresh old). Ties go to the lower
worker id, so replicas with the same etcd view choose alike (under load each one also weighs
the requests it has in flight itself, which the others learn at w's next load report).

``least-loaded``: fewest requests, then least KV in use. ``round-robin``: each role in turn.
``session``: the same session key (OpenAI ``user``) always lands on the same workers while
they live (rendezvous hashing), least-loaded without a key. These three disaggregate by prompt
length alone. Every plan carries a reason (``kv-hit``, ``load``, ``decode-only``,
``round-robin``, ``session``) that the router counts per policy.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from libkv.cluster.registry import Member, MemberDirectory
from libkv.hashing import BlockHash, encode_extra_keys, hash_prefix_blocks
from libkv.kv_layout import pair_refusal
from libkv.transfer import handoff_path

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
    max_tokens: int = 16
    lora: str = ""  # LoRA adapter: only workers that hold it serve the request


@dataclass(frozen=True, slots=True)
class Plan:
    """Where one request runs: ``prefill`` None means decode-only."""

    decode: Member
    prefill: Member | None
    reason: str
    cached_blocks: int = 0  # blocks the computing worker is expected to hold


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    name: str = "kv"
    decode_only_threshold: int = 256
    load_weight: float = 0.5

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

    def cached_blocks(self, m: Member) -> int:
        if self.index is None:
            return 0
        bs = m.block_size or DEFAULT_BLOCK_SIZE
        if bs not in self._depths:
            self._depths[bs] = self.index.match(self.hashes(bs))
        return self._depths[bs].get((m.worker_id, m.incarnation), 0)

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

    def load(self, m: Member) -> int:
        return max(self.inflight[m.worker_id], m.load.queue_length + m.load.running)

    # -- plans ----------------------------------------------------------------------------------
    def plan(self, req: RouteRequest, exclude: set[str]) -> Plan | None:
        """Workers for ``req`` avoiding ``exclude``; None when no decode worker is live."""
        decoders = self.live("decode", exclude, req.lora)
        if not decoders:
            return None
        if self.config.name == "kv":
            return self._plan_kv(req, decoders, exclude)
        decode = self._pick(req, decoders, "decode")
        prefill = None
        if len(req.prompt) >= self.config.decode_only_threshold:
            prefill = self.pick_prefill(req, exclude, decode)
        if prefill is None:
            return Plan(decode, None, "decode-only")
        reason = {"least-loaded": "load", "round-robin": "round-robin"}.get(self.config.name)
        return Plan(decode, prefill, reason or ("session" if req.session else "load"))

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
            best = min(candidates, key=lambda m: self._cost(req, chain, m, 1.0))
            chain.remember(best)
            return best
        return self._pick(req, candidates, "prefill")

    def _plan_kv(self, req: RouteRequest, decoders: list[Member], exclude: set[str]) -> Plan:
        chain = _Chain(req, self.index)
        decode = min(decoders, key=lambda m: self._cost(req, chain, m, 1.0))
        hit = chain.cached_blocks(decode)
        bs = decode.block_size or DEFAULT_BLOCK_SIZE
        uncached = len(req.prompt) - hit * bs
        prefill = None
        if uncached >= self.config.decode_only_threshold:
            candidates = self.prefill_for(decoders, exclude, req.lora)
            if candidates:
                prefill = min(candidates, key=lambda m: self._cost(req, chain, m, 1.0))
        if prefill is None:
            chain.remember(decode)
            return Plan(decode, None, "decode-only", hit)
        paired_decoders = [d for d in decoders if paired(prefill, d)]
        decode = min(paired_decoders, key=lambda m: self._cost(req, chain, m, TRANSFER_WEIGHT))
        hit = chain.cached_blocks(prefill)
        chain.remember(prefill, decode)  # the decode worker caches the blocks it receives
        return Plan(decode, prefill, "kv-hit" if hit else "load", hit)

    # -- scoring ----------------------------------------------------------------------------------
    def _cost(
        self, req: RouteRequest, chain: _Chain, m: Member, miss_weight: float
    ) -> tuple[float, str]:
        bs = m.block_size or DEFAULT_BLOCK_SIZE
        blocks = -(-len(req.prompt) // bs)
        miss = blocks - min(chain.cached_blocks(m), blocks)
        cost = miss_weight * miss + self.config.load_weight * self.load(m) * blocks
        need = miss + -(-req.max_tokens // bs)
        reported = m.load.kv_blocks_free + m.load.kv_blocks_used > 0  # a load report arrived
        if reported and m.load.kv_blocks_free < need:
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
