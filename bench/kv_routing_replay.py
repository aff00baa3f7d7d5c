"""Deterministic replay of ``tandem bench``'s KV-routing workloads through the real routing
parts, in virtual time, against an exact oracle: why a routed request missed a cached prefix.

Real: etcd (a fresh one), one ``SummaryPublisher`` per worker writing under a real lease, the
router's ``LocationIndex`` following etcd (with ``RecentRoutes`` as the router runs it), the
router's ``Chooser`` (policy ``kv``), and each worker's ``KVCacheManager`` and ``BlockPool`` (the
bench's 64 MiB pool of SmolLM2-135M: 91 blocks), fed the bench's requests tokenized by the
model's chat template, exactly as the gateway does. Simulated: time and the workers' compute.
A request is routed when sent (a session's next turn when its previous one finished); its
prompt is computed at ``--prefill-ms`` per uncached token in FIFO order on the computing worker,
its blocks are committed at the first token (on the prefill worker and, handed over, the decode
worker), then it decodes ``output`` tokens at ``--tpot-ms`` each and its table is freed. A
publisher writes when it has changes and its last write is ``interval`` old (as its background
task does); the index then catches up with etcd before anything else happens. Workers report
their load (queued + running, free blocks) every ``member_refresh`` s, as their member refresh
does; the router's own in-flight counts are exact.

For every request the replay records what the index (and recent routes) showed per worker,
what each worker really cached (``KVCacheManager.find_prefix``), the plan, the policy's load
per worker, and, for a request that computed blocks some worker held, the cause:

- ``index-delay``: the index did not show the holder yet (cached since its last write);
- ``index-content``: it showed less than the holder held beyond the granularity's rounding;
- ``full`` / ``full-stale-report``: the holder looked too full for the request, and was (or
  was not: its load report predates requests that ended since);
- ``cold-prefill``: the holder, a decode worker, would still compute at least
  ``decode_only_threshold`` tokens, so a prefill worker holding less computed the prompt;
- ``load``: the index showed the holder's prefix, but the load term chose another worker.

``--lookup exact`` routes by the exact cache contents instead (the oracle); ``--stale-reports``
counts every load report as it is (as the router did before it noted its own requests at each
report); ``--sweep`` runs seeds 0-7 at 150 and 300 ms per output token. Usage::

    python -m bench.kv_routing_replay [--lookup summary+hints|summary|exact] [--seed N]
    python -m bench.kv_routing_replay --sweep [--stale-reports]

The replay also runs against a policy without ``Chooser.observe`` (as on the commit before
it), for comparison: its load reports are then counted as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import sys
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aetcd

from bench.workloads import WorkloadConfig, generate, make_counter, parse_workload
from libkv.block_pool import BlockPool
from libkv.cluster.etcd_follow import EtcdConnection
from libkv.cluster.recent_routes import HintedIndex, RecentRoutes
from libkv.cluster.registry import Member, MemberChange, MemberLoad
from libkv.cluster.summary_index import LocationIndex
from libkv.cluster.summary_publisher import SummaryConfig, SummaryPublisher
from libkv.hashing import encode_extra_keys, hash_prefix_blocks
from libkv.kv_manager import KVCacheManager
from services.router.policy import Chooser, PolicyConfig, RouteRequest

BS = 16
WORKERS = (
    ("prefill-0", "prefill"),
    ("prefill-1", "prefill"),
    ("decode-0", "decode"),
    ("decode-1", "decode"),
)
MODEL_DIR = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
LOOKUPS = ("summary+hints", "summary", "exact")
MULTI_TURN = "multi-turn:input=96,output=16,turns=4"  # the kv_routing_cpu run's workload


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    workload: str = MULTI_TURN
    num_requests: int = 24
    rate: float = 0.5  # sessions (units) per second, Poisson, the bench's seed
    seed: int = 0
    lookup: str = "summary+hints"
    load_weight: float = 0.5
    decode_only_threshold: int = 256
    num_blocks: int = 91  # 64 MiB of SmolLM2-135M's float32 KV (737,280 bytes a block)
    prefill_ms: float = 2.0  # per uncached prompt token
    tpot_ms: float = 150.0
    member_refresh: float = 3.0
    recent_ttl: float = 2.0
    observe_reports: bool = True  # the router notes its own in flight at each load report
    summary: SummaryConfig = field(default_factory=SummaryConfig)
    model_dir: str = str(MODEL_DIR)  # its tokenizer and chat template


@dataclass(slots=True)
class Decision:
    request: str
    tokens: int
    at: float
    reason: str
    prefill: str
    decode: str
    computing: str  # the worker that computes the prompt
    shown: dict[str, int]  # blocks the router's lookup showed per worker
    exact: dict[str, int]  # blocks each worker really held
    got: int  # blocks the computing worker held (and reused)
    ideal: int  # blocks of the prompt in any earlier prompt (one shared, unbounded cache)
    output: int = 0
    cause: str = ""  # why got < the best holder's (see the module docstring)
    load: dict[str, tuple[int, int]] = field(default_factory=dict)  # policy's, own in flight


class _Directory:
    def __init__(self, members: list[Member]) -> None:
        self.members = members

    def members_by_role(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]


class _Lease:
    def __init__(self, lease_id: int) -> None:
        self.lease_id, self.registered, self.registrations = lease_id, True, 1


class ExactLookup:
    """The oracle: every worker's real prefix cache, looked up block by block."""

    def __init__(self, kvs: Mapping[tuple[str, str], KVCacheManager]) -> None:
        self.kvs = kvs
        self.tokens: Sequence[int] = ()

    def match(self, hashes: Sequence[bytes]) -> dict[tuple[str, str], int]:
        out = {}
        for holder, kv in self.kvs.items():
            n = len(kv.find_prefix(self.tokens).blocks)
            if n:
                out[holder] = n
        return out


class Replay:
    def __init__(self, cfg: ReplayConfig, endpoint: str) -> None:
        self.cfg, self.endpoint = cfg, endpoint
        self.now = 0.0
        self.kvs = {w: KVCacheManager(BlockPool(cfg.num_blocks, BS)) for w, _ in WORKERS}
        self.busy = dict.fromkeys(self.kvs, 0.0)  # prompt compute queued until
        self.running = Counter[str]()  # sequences in each engine (for its load report)
        self.queued = Counter[str]()
        self.inflight = Counter[str]()  # the router's
        self.inc = uuid.uuid4().hex  # this run's incarnation (an etcd may serve several runs)
        self.members = [
            Member(w, role, "m", "127.0.0.1:1", cfg.num_blocks, BS, self.inc) for w, role in WORKERS
        ]
        self.last_write = dict.fromkeys(self.kvs, float("-inf"))
        self.events: list[tuple[float, int, str, tuple]] = []
        self._n = 0
        self.decisions: list[Decision] = []
        self.seen: set[bytes] = set()  # every prompt's block hashes so far (the ideal cache)
        self.full = 0
        self._cached_at: dict[tuple[str, int], float] = {}  # (worker, depth) -> first cached
        self._ticks: set[float] = set()

    def at(self, t: float, kind: str, *args) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, self._n, kind, args))

    async def run(self) -> list[Decision]:
        cfg = self.cfg
        from bench.runner import arrival_times
        from engine.tokenizer import Tokenizer

        wl = generate(
            parse_workload(cfg.workload, WorkloadConfig("random", cfg.num_requests, cfg.seed)),
            make_counter(cfg.model_dir),
        )
        tok = Tokenizer(cfg.model_dir)
        self.conn = EtcdConnection(self.endpoint, 5.0, "replay")
        self.pubs = {}
        self.leases: list = []
        for w in self.kvs:
            lease = await self.conn.client.lease(3600)
            self.leases.append(lease)
            pub = SummaryPublisher(
                self.endpoint, w, self.inc, _Lease(lease.id), cfg.summary, etcd=self.conn
            )
            self.kvs[w].set_listener(pub)
            self.pubs[w] = pub
        self.index = await LocationIndex.start(self.endpoint)
        hinted = HintedIndex(self.index, RecentRoutes(cfg.recent_ttl, clock=lambda: self.now))
        self.exact = ExactLookup({(w, self.inc): kv for w, kv in self.kvs.items()})
        lookup = {"summary": self.index, "summary+hints": hinted, "exact": self.exact}
        policy = PolicyConfig("kv", cfg.decode_only_threshold, cfg.load_weight)
        self.chooser = Chooser(_Directory(self.members), policy, lookup[cfg.lookup], self.inflight)
        for t, unit in zip(arrival_times(len(wl.units), cfg.rate, cfg.seed), wl.units, strict=True):
            prompts = [
                (
                    r.request_id,
                    tok.encode_chat([{"role": m.role, "content": m.content} for m in r.messages]),
                    r.output_tokens,
                )
                for r in unit
            ]
            self.at(t, "send", prompts)
        k = 0
        while k * cfg.member_refresh <= 600:
            self.at(k * cfg.member_refresh, "report")
            k += 1
        try:
            while self.events and any(e[2] != "report" for e in self.events):
                t, _, kind, args = heapq.heappop(self.events)
                self.now = t
                await self._publish()
                getattr(self, "_" + kind)(*args)
            await self._publish()
        finally:
            await self.index.stop()
            for lease in self.leases:  # the run's keys go with them
                await lease.revoke()
            await self.conn.close()
        return self.decisions

    # -- publishing ---------------------------------------------------------------------------
    async def _publish(self) -> None:
        """Every publisher whose last write is ``interval`` old writes its changes (its
        background task polls every 0.1 s); the index then catches up with etcd."""
        wrote = False
        for w, pub in self.pubs.items():
            if self.now - self.last_write[w] >= self.cfg.summary.interval and await pub.flush():
                self.last_write[w] = self.now
                wrote = True
            elif pub.state._dirty:  # noqa: SLF001 - changes wait for the interval
                t = self.last_write[w] + self.cfg.summary.interval
                if t not in self._ticks:
                    self._ticks.add(t)
                    self.at(t, "tick")
        if wrote:
            req = aetcd.rpc.RangeRequest(key=b"\0", range_end=b"\0", count_only=True)
            rev = (await self.conn.client.kvstub.Range(req, timeout=10)).header.revision
            await self.index.wait_for(lambda ix: ix.follower.revision >= rev, 10)

    def _tick(self) -> None:
        pass

    def _report(self) -> None:
        for i, m in enumerate(self.members):
            pool = self.kvs[m.worker_id].pool
            load = MemberLoad(
                self.queued[m.worker_id], self.running[m.worker_id], pool.num_used, pool.num_free
            )
            self.members[i] = Member(
                m.worker_id,
                m.role,
                m.model,
                m.address,
                m.kv_blocks_total,
                m.block_size,
                m.incarnation,
                load=load,
            )
            observe = getattr(self.chooser, "observe", None)
            if self.cfg.observe_reports and observe is not None:  # as the router's watcher does
                observe(MemberChange("put", m.worker_id, self.members[i]))
        self.chooser.directory = _Directory(self.members)

    # -- requests -----------------------------------------------------------------------------
    def _send(self, turns: list[tuple[str, list[int], int]]) -> None:
        rid, prompt, out = turns[0]
        self.exact.tokens = prompt
        req = RouteRequest(prompt, max_tokens=out)
        shown = {}
        lookup = self.chooser.index
        hashes = hash_prefix_blocks(prompt, BS, encode_extra_keys(None))
        if lookup is not None:
            match = lookup.match(hashes)
            shown = {w: match.get((w, self.inc), 0) for w in self.kvs}
        exact = {w: len(kv.find_prefix(prompt).blocks) for w, kv in self.kvs.items()}
        ideal = 0
        while ideal < len(hashes) and hashes[ideal] in self.seen:
            ideal += 1
        self.seen.update(hashes)
        plan = self.chooser.plan(req, set())
        assert plan is not None
        computing = (plan.prefill or plan.decode).worker_id
        d = Decision(
            rid,
            len(prompt),
            round(self.now, 3),
            plan.reason,
            plan.prefill.worker_id if plan.prefill else "-",
            plan.decode.worker_id,
            computing,
            shown,
            exact,
            exact[computing],
            ideal,
            out,
        )
        d.cause = self._cause(d, plan.prefill is None)
        d.load = {
            m.worker_id: (self.chooser.load(m), self.inflight[m.worker_id]) for m in self.members
        }
        self.decisions.append(d)
        self._start(computing, prompt, rid)
        first = self.busy[computing]
        self._book(computing, len(prompt) + out, 1)
        if plan.prefill is not None:
            self.at(
                first, "handoff", plan.prefill.worker_id, plan.decode.worker_id, prompt, rid, out
            )
        self.at(
            first + out * self.cfg.tpot_ms / 1000,
            "finish",
            plan.decode.worker_id,
            turns,
            plan.prefill is None,
        )

    def _cause(self, d: Decision, decode_only: bool) -> str:
        best = max(d.exact.values())
        if d.got >= best:
            return ""
        holders = [w for w, n in d.exact.items() if n == best]
        if any(
            d.shown.get(w, 0) >= best - best % self.cfg.summary.base and d.shown.get(w, 0)
            for w in holders
        ):
            # The index had it: who lost?
            w = holders[0]
            m = next(m for m in self.members if m.worker_id == w)
            need = -(-d.tokens // BS) - d.shown[w] + -(-d.output // BS)  # as Chooser._cost
            free = getattr(self.chooser, "free_blocks", lambda m: m.load.kv_blocks_free)(m)
            if m.load.kv_blocks_free + m.load.kv_blocks_used and free < need:
                real = self.kvs[w].pool.num_free
                return "full" if real < need else "full-stale-report"
            if w.startswith("decode") and not decode_only:
                uncached = d.tokens - d.shown[w] * BS
                if uncached >= self.cfg.decode_only_threshold:
                    return "cold-prefill"
            return "load"
        w = holders[0]
        if d.shown.get(w, 0) == 0 and self.last_write[w] < self._cached_at.get((w, best), 0):
            return "index-delay"
        return "index-content"

    def _start(self, w: str, prompt: list[int], rid: str) -> None:
        kv = self.kvs[w]
        hit = kv.find_prefix(prompt)
        start = max(self.now, self.busy[w])
        self.busy[w] = start + (len(prompt) - len(hit.blocks) * BS) * self.cfg.prefill_ms / 1000
        self.queued[w] += 1
        self.at(self.busy[w], "computed", w, prompt, rid)

    def _computed(self, w: str, prompt: list[int], rid: str) -> None:
        kv = self.kvs[w]
        self.queued[w] -= 1
        self.running[w] += 1
        hit = kv.find_prefix(prompt)
        n = len(prompt)
        if kv.admit(rid, hit, min(len(hit.blocks) * BS, n - 1), n + 1, b"") is None:
            self.full += 1
            return
        kv.commit(rid, prompt, n)
        for i in range(len(prompt) // BS):
            self._cached_at.setdefault((w, i + 1), self.now)

    def _book(self, w: str, tokens: int, sign: int) -> None:
        """What the router's core counts while a call to ``w`` runs (``Chooser.working``)."""
        self.inflight[w] += sign
        blocks = getattr(self.chooser, "inflight_blocks", None)
        if blocks is not None:
            blocks[w] += sign * -(-tokens // BS)

    def _handoff(self, prefill: str, decode: str, prompt: list[int], rid: str, out: int) -> None:
        self._book(prefill, len(prompt) + out, -1)
        self._book(decode, len(prompt) + out, 1)
        self.running[prefill] -= 1
        if rid in self.kvs[prefill]:
            self.kvs[prefill].free(rid)
        self.running[decode] += 1
        kv = self.kvs[decode]
        hit = kv.find_prefix(prompt)
        if kv.admit(rid, hit, len(hit.blocks) * BS, len(prompt) + 1, b"") is None:
            self.full += 1
            return
        kv.commit(rid, prompt, len(prompt))

    def _finish(self, decode: str, turns: list, decode_only: bool) -> None:
        rid, prompt, out = turns[0]
        self._book(decode, len(prompt) + out, -1)
        self.running[decode] -= 1
        kv = self.kvs[decode]
        if rid in kv:
            tokens = list(prompt) + [1000 + i for i in range(out)]  # its own answer
            if kv.grow(rid, len(prompt), len(tokens)) is not None:  # else: no room to grow
                kv.commit(rid, tokens, len(tokens))
            kv.free(rid)
        if len(turns) > 1:
            self.at(self.now, "send", turns[1:])


def summarize(decisions: list[Decision]) -> dict:
    prompt = sum(d.tokens for d in decisions)
    got = sum(d.got * BS for d in decisions)
    ideal = sum(d.ideal * BS for d in decisions)
    return {
        "requests": len(decisions),
        "hit_rate": got / prompt,
        "ideal_hit_rate": ideal / prompt,
        "vs_ideal": got / ideal if ideal else float("nan"),
        "reasons": dict(Counter(d.reason for d in decisions)),
        "computing": dict(sorted(Counter(d.computing for d in decisions).items())),
        "decoding": dict(sorted(Counter(d.decode for d in decisions).items())),
        "causes": dict(Counter(d.cause for d in decisions if d.cause)),
        "missed_blocks": dict(
            sum(
                (Counter({d.cause: max(d.exact.values()) - d.got}) for d in decisions if d.cause),
                Counter(),
            )
        ),
    }


async def replay(cfg: ReplayConfig, endpoint: str) -> tuple[list[Decision], dict]:
    r = Replay(cfg, endpoint)
    decisions = await r.run()
    return decisions, {**summarize(decisions), "no_room": r.full}


def sweep(a: argparse.Namespace) -> int:
    """One line per (seed, ms per output token), then the mean and the least."""
    from services.launcher.etcd import EtcdServer

    async def run(endpoint: str) -> list[float]:
        out = []
        for seed in range(8):
            for tpot in (150.0, 300.0):
                cfg = ReplayConfig(workload=a.workload, lookup=a.lookup, seed=seed,
                                   load_weight=a.load_weight, tpot_ms=tpot, prefill_ms=tpot / 75,
                                   observe_reports=not a.stale_reports)  # fmt: skip
                _, s = await replay(cfg, endpoint)
                out.append(s["vs_ideal"])
                print(f"seed {seed} tpot {tpot:.0f} ms: {s['hit_rate']:.1%} hit, "
                      f"{s['vs_ideal']:.1%} of the shared cache; misses {s['causes']}; "
                      f"decode {s['decoding']}", flush=True)  # fmt: skip
        return out

    with EtcdServer() as etcd:
        ratios = asyncio.run(run(etcd.endpoint))
    print(f"of the shared cache: mean {sum(ratios) / len(ratios):.1%}, least {min(ratios):.1%}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from services.launcher.etcd import EtcdServer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lookup", choices=LOOKUPS, default="summary+hints")
    p.add_argument("--load-weight", type=float, default=0.5)
    p.add_argument("--workload", default=MULTI_TURN, help="as tandem bench's")
    p.add_argument("--prefill-ms", type=float, default=2.0, help="per uncached prompt token")
    p.add_argument("--tpot-ms", type=float, default=150.0)
    p.add_argument("--rate", type=float, default=0.5, help="sessions per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stale-reports",
        action="store_true",
        help="the router does not note its own in flight at load reports (as "
        "before this fix: a report counts as it is)",
    )
    p.add_argument("--sweep", action="store_true", help="seeds 0-7 x 150/300 ms per token")
    p.add_argument("--json", type=Path, help="write every decision here")
    a = p.parse_args(argv)
    if a.sweep:
        return sweep(a)
    cfg = ReplayConfig(
        workload=a.workload,
        lookup=a.lookup,
        load_weight=a.load_weight,
        prefill_ms=a.prefill_ms,
        tpot_ms=a.tpot_ms,
        rate=a.rate,
        seed=a.seed,
        observe_reports=not a.stale_reports,
    )
    with EtcdServer() as etcd:
        decisions, summary = asyncio.run(replay(cfg, etcd.endpoint))
    for d in decisions:
        shown = " ".join(f"{w[0]}{w[-1]}={d.shown.get(w, 0)}/{d.exact[w]}" for w in d.exact)
        print(
            f"{d.at:7.2f} {d.request} {d.tokens:4d} {d.reason:11s} p={d.prefill:9s} "
            f"d={d.decode:8s} got {d.got:2d} best {max(d.exact.values()):2d} ideal "
            f"{d.ideal:2d}  shown/exact {shown} load {list(d.load.values())} {d.cause}"
        )
    print(json.dumps(summary, indent=1))
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "config": asdict(cfg) | {"summary": asdict(cfg.summary)},
                    "summary": summary,
                    "decisions": [asdict(d) for d in decisions],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
