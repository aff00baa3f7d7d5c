"""The router's metrics, read from its core and member view at scrape time: routing decisions
by policy and reason, disaggregation decisions by choice and reason, retries, and live members
by role."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

ROLES = ("prefill", "decode", "router")


def decision_labels(key: Any) -> tuple[str, str]:
    """(policy, reason) of a `RouterStats.decisions` key: a (policy, reason) pair, or a bare
    reason recorded without a policy name."""
    if isinstance(key, tuple) and len(key) == 2:
        return str(key[0]), str(key[1])
    return "default", str(key)


class RouterCollector(Collector):
    """``tandem_router_decisions_total{policy,reason}``, ``tandem_router_retries_total``,
    ``tandem_router_migrations_total``, ``tandem_router_live_moves_total``,
    ``tandem_router_local_refusals_total``, ``tandem_router_disagg_decisions_total{choice,reason}``,
    ``tandem_router_slo_shed_total``, the pool planner's ``tandem_planner_*`` and
    ``tandem_router_members{role}`` of one router, summed over its cores (one per base model);
    with a role ``balancer`` (``--balance-roles``), ``tandem_router_role_orders_total{role}``."""

    def __init__(self, cores: Any, watcher: Any, balancer: Any = None) -> None:
        self.cores = list(cores)
        self.watcher = watcher
        self.balancer = balancer  # a RoleBalancer, or None on a router that does not balance

    def collect(self) -> Iterator[Metric]:
        every = [core.stats for core in self.cores]
        decisions = CounterMetricFamily(
            "tandem_router_decisions",
            "Routing decisions by policy and reason (e.g. kv-hit, load, decode-only).",
            labels=["policy", "reason"],
        )
        totals: Counter[tuple[str, str]] = Counter()
        for stats in every:
            for key, n in dict.copy(stats.decisions).items():  # dict.copy: atomic under the GIL
                totals[decision_labels(key)] += n
        for (policy, reason), n in sorted(totals.items()):
            decisions.add_metric([policy, reason], n)
        yield decisions
        disagg = CounterMetricFamily(
            "tandem_router_disagg_decisions",
            "Where prompts were computed: choice disagg (a prefill worker, then a hand-off) or "
            "decode-only, by reason (headroom, saturated, both-miss: the SLO prediction; "
            "cold-start, no-prefill).",
            labels=["choice", "reason"],
        )
        split: Counter[tuple[str, str]] = Counter()
        for stats in every:
            split.update(dict.copy(stats.disagg))
        for (choice, reason), n in sorted(split.items()):
            disagg.add_metric([choice, reason], n)
        yield disagg
        yield CounterMetricFamily(
            "tandem_router_slo_shed",
            "Requests refused because their predicted TTFT was past --slo-shed-factor times "
            "their objective.",
            value=sum(core.slo_gate.shed for core in self.cores),
        )
        yield CounterMetricFamily(
            "tandem_router_retries",
            "Requests retried on another worker after a failure before their first token.",
            value=sum(stats.retries for stats in every),
        )
        yield CounterMetricFamily(
            "tandem_router_migrations",
            "Streams moved to another decode worker after their worker failed mid-stream.",
            value=sum(stats.migrations for stats in every),
        )
        yield CounterMetricFamily(
            "tandem_router_live_moves",
            "Of those, streams a draining decode worker handed over with their KV.",
            value=sum(stats.live_moves for stats in every),
        )
        legs = CounterMetricFamily(
            "tandem_router_decode_legs",
            "Decode calls by who streamed their tokens: the gateway (the router's Route, the "
            "router out of the token path) or the router (its Generate, relayed).",
            labels=["streamed_by"],
        )
        by_whom: Counter[str] = Counter(dict.fromkeys(("gateway", "router"), 0))
        for stats in every:
            by_whom.update(dict.copy(stats.legs))
        for who, n in sorted(by_whom.items()):
            legs.add_metric([who], n)
        yield legs
        yield CounterMetricFamily(
            "tandem_router_local_refusals",
            "Requests refused for capacity here, with no call to the decode worker (its room "
            "as this router booked it, or as the worker last said).",
            value=sum(core.admission.local_refusals for core in self.cores),
        )
        yield from self._plans()
        if self.balancer is not None:
            orders = CounterMetricFamily(
                "tandem_router_role_orders",
                "Role orders this router's role balancer wrote, by the role ordered.",
                labels=["role"],
            )
            for role, n in sorted(dict.copy(self.balancer.moves).items()):
                orders.add_metric([role], n)
            yield orders
        members = GaugeMetricFamily(
            "tandem_router_members", "Live members in this router's view, by role.",
            labels=["role"],
        )  # fmt: skip
        by_role: Counter[str] = Counter(dict.fromkeys(ROLES, 0))
        for m in list(dict.copy(self.watcher.members).values()):
            by_role[m.role] += 1
        for role, n in sorted(by_role.items()):
            members.add_metric([role], n)
        yield members

    def _plans(self) -> Iterator[Metric]:
        """The pool planner's figures per base model (`services.router.planner`); a figure not
        known yet (no measured rate) is left out rather than exported as NaN."""
        figures = {  # metric -> (help, the Plan's field)
            "tandem_planner_prefill_workers": (
                "Prefill workers the traffic of the planner's window needs.", "prefill_workers"),
            "tandem_planner_decode_workers": (
                "Decode workers the traffic of the planner's window needs.", "decode_workers"),
            "tandem_planner_prefill_fraction": (
                "Prefill workers over all workers the planner recommends.", "prefill_fraction"),
            "tandem_planner_prompt_tokens_per_second": (
                "Uncached prompt tokens routed per second (window).", "prompt_tokens_per_s"),
            "tandem_planner_output_tokens_per_second": (
                "Completion tokens streamed per second (window).", "output_tokens_per_s"),
            "tandem_planner_prefill_rate_tokens_per_second": (
                "Prompt tokens per second one prefill worker computes (measured).",
                "prefill_rate"),
            "tandem_planner_decode_rate_tokens_per_second": (
                "Completion tokens per second one decode worker makes at the TPOT objective "
                "(fitted).", "decode_rate"),
        }  # fmt: skip
        families = {
            name: GaugeMetricFamily(name, doc, labels=["base_model"])
            for name, (doc, _) in figures.items()
        }
        for core in self.cores:
            plan = core.planner.plan(core.workers(), core.chooser.disagg.default_slo.tpot_s)
            for name, (_, field) in figures.items():
                v = getattr(plan, field)
                if not math.isnan(v):
                    families[name].add_metric([core.model], v)
        yield from families.values()
