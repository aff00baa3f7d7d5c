"""Write the Grafana dashboards of the chart, ``helm/tandem/dashboards/*.json``, from the metric
names the services export (``services/*/metrics``, ``services/gateway/observe.py``).

    python helm/generate_dashboards.py          # rewrite the JSON files
    python helm/generate_dashboards.py --check  # exit 1 if they are stale (tests run this)

Every query selects ``namespace``, ``model`` and ``worker`` through template variables; the
chart loads the files as ConfigMaps for the Grafana sidecar.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dashboard_lib import Dashboard, Panel, Target, quantile, rate, ratio, sel  # noqa: E402

OUT = Path(__file__).resolve().parent / "tandem" / "dashboards"
QUANTILES = ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"))
TOK = "suffix: tok/s"


def percentiles(
    histogram: str, by: str = "", legend: str = "", extra: str = ""
) -> tuple[Target, ...]:
    return tuple(
        Target(quantile(q, histogram, by, extra), f"{name} {legend}".strip())
        for q, name in QUANTILES
    )


def zero_if_none(expr: str, like: str) -> str:
    """``expr``, or 0 for every series of ``like`` when ``expr`` has none (no errors yet)."""
    return f"({expr}) or ({like} * 0)"


REQS = "tandem_gateway_requests_total"
ALL_REQS = f"sum({rate(REQS)})"
FINISHED = "sum(" + rate(REQS, 'finish_reason=~"stop|length"') + ")"
S5XX = "sum(" + rate(REQS, 'status=~"5.."') + ")"
S429 = "sum(" + rate(REQS, 'status="429"') + ")"


def overview() -> Dashboard:
    d = Dashboard(
        "tandem-overview",
        "Tandem / Overview",
        "Traffic, errors, latency and goodput as clients see them at the gateway.",
    )
    d.row(
        "Traffic and errors",
        Panel("Request rate", "HTTP requests answered per second, by route and status.", "reqps",
              (Target(f"sum by (route, status) ({rate(REQS)})", "{{route}} {{status}}"),)),
        Panel("Error ratio", "Share of requests answered 5xx (server errors) and 429 (rejected "
              "by admission control or rate limits).", "percentunit",
              (Target(ratio(zero_if_none(S5XX, ALL_REQS), ALL_REQS), "5xx"),
               Target(ratio(zero_if_none(S429, ALL_REQS), ALL_REQS), "429"))),
        Panel("Requests in flight", "HTTP requests being served by the gateways.", "short",
              (Target(f"sum(tandem_gateway_requests_in_flight{{{sel()}}})", "in flight"),)),
        Panel("Tokens per second", "Prompt tokens in and generated tokens out, per second.", TOK,
              (Target(f"sum({rate('tandem_gateway_input_tokens_total')})", "input"),
               Target(f"sum({rate('tandem_gateway_output_tokens_total')})", "output"))),
    )  # fmt: skip
    d.row(
        "Latency",
        Panel("Time to first token", "TTFT percentiles: arrival at the gateway to the first "
              "token.", "s", percentiles("tandem_gateway_time_to_first_token_seconds")),
        Panel("Time per output token", "TPOT percentiles: (end to end - TTFT) / (tokens - 1).",
              "s", percentiles("tandem_gateway_time_per_output_token_seconds")),
        Panel("Inter-token latency", "Gap between consecutive token events of a stream.", "s",
              percentiles("tandem_gateway_inter_token_latency_seconds")),
        Panel("End-to-end latency", "Arrival to last token of finished requests.", "s",
              percentiles("tandem_gateway_e2e_request_latency_seconds")),
    )  # fmt: skip
    d.row(
        "Goodput and SLOs",
        Panel("Goodput", "Finished requests per second that met both the TTFT and the TPOT SLO.",
              "reqps", (Target(f"sum({rate('tandem_gateway_goodput_requests_total')})",
                               "goodput"),)),
        Panel("SLO attainment", "Share of finished requests (stop or length) within both SLOs.",
              "percentunit", (Target(ratio(f"sum({rate('tandem_gateway_goodput_requests_total')})",
                                           FINISHED), "attainment"),)),
        Panel("SLO thresholds", "The TTFT and TPOT SLOs (seconds) each gateway counts goodput "
              "against (--slo-ttft-ms, --slo-tpot-ms).", "short",
              (Target(f"max by (ttft_seconds, tpot_seconds) (tandem_gateway_slo_info{{{sel()}}})",
                      "TTFT {{ttft_seconds}} s, TPOT {{tpot_seconds}} s"),), kind="table"),
    )  # fmt: skip
    return d


ENGINE_BY = "component, worker"


def mean(histogram: str, by: str) -> str:
    return ratio(f"sum by ({by}) ({rate(histogram + '_sum')})",
                 f"sum by ({by}) ({rate(histogram + '_count')})")  # fmt: skip


def pools() -> Dashboard:
    d = Dashboard("tandem-pools", "Tandem / Prefill and decode pools",
                  "Queues, batches and step times of every prefill and decode worker.")  # fmt: skip
    d.row(
        "Queues",
        Panel("Running sequences", "Sequences in each worker's running batch.", "short",
              (Target(f"sum by ({ENGINE_BY}) (tandem_engine_sequences_running{{{sel()}}})",
                      "{{worker}}"),)),
        Panel("Waiting sequences", "Sequences queued in each worker, not yet scheduled.", "short",
              (Target(f"sum by ({ENGINE_BY}) (tandem_engine_sequences_waiting{{{sel()}}})",
                      "{{worker}}"),)),
        Panel("Queue time", "Arrival at the engine to first scheduling, by pool.", "s",
              percentiles("tandem_engine_queue_time_seconds", "component", "{{component}}")),
        Panel("Engine TTFT", "Arrival at the engine to the first token read back (queue time "
              "plus the prompt's steps), by pool: the engine's part of the gateway's TTFT.", "s",
              percentiles("tandem_engine_time_to_first_token_seconds", "component",
                          "{{component}}")),
        Panel("Preemptions", "Sequences preempted for lack of KV blocks, per second.", "ops",
              (Target(f"sum by ({ENGINE_BY}) ({rate('tandem_engine_preemptions_total')})",
                      "{{worker}}"),)),
    )  # fmt: skip
    d.row(
        "Admission",
        Panel("Admitted tokens", "Tokens of the requests admitted and running, and the "
              "admission bound (0: none), per gateway and worker.", "short",
              (Target(f"sum by ({ENGINE_BY}) (tandem_admission_pending_tokens{{{sel()}}})",
                      "{{worker}} admitted"),
               Target(f"sum by ({ENGINE_BY}) (tandem_admission_limit_tokens{{{sel()}}})",
                      "{{worker}} bound"))),
        Panel("Refused at admission", "Requests refused at the bound (429 at the gateway, "
              "RESOURCE_EXHAUSTED from workers) per second, by component and priority.", "ops",
              (Target(f"sum by (component, priority) ({rate('tandem_admission_refused_total')})",
                      "{{component}} {{priority}}"),)),
    )  # fmt: skip
    d.row(
        "Batches and steps",
        Panel("Mean batch size (sequences)", "Sequences per engine step, by worker and phase "
              "(prefill: the step computed prompt tokens).", "short",
              (Target(mean("tandem_engine_batch_size_sequences", f"{ENGINE_BY}, phase"),
                      "{{worker}} {{phase}}"),)),
        Panel("Mean batch size (tokens)", "Tokens computed per engine step, by worker and phase.",
              "short", (Target(mean("tandem_engine_batch_size_tokens", f"{ENGINE_BY}, phase"),
                               "{{worker}} {{phase}}"),)),
        Panel("Step time", "Engine step time percentiles, by pool and phase.", "s",
              percentiles("tandem_engine_step_duration_seconds", "component, phase",
                          "{{component}} {{phase}}")),
        Panel("Steps per second", "Engine steps per second, by worker.", "ops",
              (Target(f"sum by ({ENGINE_BY}) "
                      f"({rate('tandem_engine_step_duration_seconds_count')})", "{{worker}}"),)),
    )  # fmt: skip
    grpc = "tandem_grpc_server_handling_seconds"
    grpc_errors = "sum by (method, code) (" + rate(grpc + "_count", 'code!="OK"') + ")"
    d.row(
        "gRPC",
        Panel("gRPC latency p99", "99th percentile of gRPC call time (streams: to their end), "
              "by method.", "s", (Target(quantile(0.99, grpc, "method"), "{{method}}"),)),
        Panel("gRPC errors", "gRPC calls per second ending in a status other than OK.", "ops",
              (Target(zero_if_none(grpc_errors, f"sum by (method) ({rate(grpc + '_count')})"),
                      "{{method}} {{code}}"),)),
    )  # fmt: skip
    return d


def kv() -> Dashboard:
    d = Dashboard(
        "tandem-kv",
        "Tandem / KV cache and transfer",
        "KV cache use and prefix hits per worker, and KV transfers between pools.",
    )
    used_sel = sel('state="used"')
    used = f"sum by ({ENGINE_BY}) (tandem_engine_kv_blocks{{{used_sel}}})"
    cap = f"sum by ({ENGINE_BY}) (tandem_engine_kv_blocks_capacity{{{sel()}}})"
    hits = f"sum by (component) ({rate('tandem_engine_prefix_cache_hit_tokens_total')})"
    prompt = f"sum by (component) ({rate('tandem_engine_prompt_tokens_total')})"
    d.row(
        "KV cache",
        Panel("KV cache utilisation", "Blocks referenced by requests over the pool, by worker.",
              "percentunit", (Target(ratio(used, cap), "{{worker}}"),)),
        Panel("KV blocks by state", "Used (referenced), cached (free, holding a reusable prefix) "
              "and free blocks, all workers.", "short",
              (Target(f"sum by (state) (tandem_engine_kv_blocks{{{sel()}}})", "{{state}}"),),
              stacked=True),
        Panel("Prefix-cache hit rate", "Prompt tokens served from the prefix cache over prompt "
              "tokens, by pool.", "percentunit", (Target(ratio(hits, prompt), "{{component}}"),)),
        Panel("KV held for decode", "Prefilled requests whose blocks wait for a decode worker.",
              "short", (Target(f"sum by (worker) (tandem_engine_kv_held_requests{{{sel()}}})",
                               "{{worker}}"),)),
    )  # fmt: skip
    tier_used = f"sum by (tier) (tandem_engine_kv_tier_used_blocks{{{sel()}}})"
    tier_cap = f"sum by (tier) (tandem_engine_kv_tier_capacity_blocks{{{sel()}}})"
    tier_hits = f"sum by (tier) ({rate('tandem_engine_kv_tier_hit_tokens_total')})"
    paged = "tandem_engine_kv_tier_page"
    d.row(
        "KV tiers (GPU, host)",
        Panel("Tier occupancy", "Blocks holding data over each tier's capacity: GPU (used + "
              "cached) and the host tier (--kv-host-cache-gib).", "percentunit",
              (Target(ratio(tier_used, tier_cap), "{{tier}}"),)),
        Panel("Prefix hits by tier", "Prompt tokens per second served from the GPU prefix "
              "cache and paged in from the host tier instead of computed.", TOK,
              (Target(tier_hits, "{{tier}}"),), stacked=True),
        Panel("Host tier paging", "Bytes per second copied out to the host tier "
              "(write-through) and paged back in.", "Bps",
              (Target(f"sum by (direction) ({rate(paged + '_bytes_total')})",
                      "{{direction}}"),)),
        Panel("Host tier copy bandwidth", "Bytes copied over the device time of those copies "
              "(CUDA events), by direction: what one copy achieves, not the load.", "Bps",
              (Target(ratio(f"sum by (direction) ({rate(paged + '_bytes_total')})",
                            f"sum by (direction) ({rate(paged + '_seconds_total')})"),
                      "{{direction}}"),)),
        Panel("Preempted sequences resumed", "Per second, by how: swapped in from the host "
              "tier or recomputed.", "ops",
              (Target(f"sum by (how) ({rate('tandem_engine_preemption_resumes_total')})",
                      "{{how}}"),)),
    )  # fmt: skip
    xfer = "tandem_kv_transfer"
    d.row(
        "KV transfer",
        Panel("Transfer bandwidth", "KV bytes obtained by decode workers per second, by "
              "transport.", "Bps",
              (Target(f"sum by (transport) ({rate(xfer + '_bytes_total')})", "{{transport}}"),)),
        Panel("Transfers per second", "Completed KV transfers per second, by transport.", "ops",
              (Target(f"sum by (transport) ({rate('tandem_kv_transfers_total')})",
                      "{{transport}}"),)),
        Panel("Transfer latency", "Time to obtain a request's KV blocks, by transport.", "s",
              percentiles(xfer + "_duration_seconds", "transport", "{{transport}}")),
        Panel("Transfer failures", "KV transfers that failed per second (the decode worker "
              "recomputes or the router retries).", "ops",
              (Target(f"sum by (transport) ({rate(xfer + '_failures_total')})",
                      "{{transport}}"),)),
    )  # fmt: skip
    return d


def router() -> Dashboard:
    d = Dashboard(
        "tandem-router",
        "Tandem / Router",
        "Routing decisions, live members and the health of the control plane.",
    )
    decisions = "tandem_router_decisions_total"
    d.row(
        "Decisions",
        Panel("Decisions per second", "Routing decisions by policy and reason (kv-hit, load, "
              "decode-only, ...).", "ops",
              (Target(f"sum by (policy, reason) ({rate(decisions)})",
                      "{{policy}} {{reason}}"),)),
        Panel("Decision share", "Share of decisions by reason.", "percentunit",
              (Target(f"sum by (reason) ({rate(decisions)}) / ignoring(reason) group_left "
                      f"clamp_min(sum({rate(decisions)}), 1e-9)", "{{reason}}"),), stacked=True),
        Panel("Retries, migrations, local refusals", "Requests retried on another worker "
              "before their first token, streams migrated after it, and requests refused for "
              "capacity by the router itself (no call to a worker), per second.", "ops",
              (Target(f"sum({rate('tandem_router_retries_total')})", "retries"),
               Target(f"sum({rate('tandem_router_migrations_total')})", "migrations"),
               Target(f"sum({rate('tandem_router_local_refusals_total')})", "local refusals"))),
        Panel("Router stream time", "Router Route (the gateway's) and Generate calls, start "
              "to last token.", "s",
              percentiles("tandem_grpc_server_handling_seconds", extra='component="router", '
                          'method=~"/tandem.v1.Router/(Route|Generate)"')),
        Panel("Decode legs", "Decode calls per second by who streamed their tokens: the "
              "gateway (the router out of the token path) or the router (relayed).", "ops",
              (Target(f"sum by (streamed_by) ({rate('tandem_router_decode_legs_total')})",
                      "{{streamed_by}}"),)),
    )  # fmt: skip
    split = "tandem_router_disagg_decisions_total"
    disagg_rate = "sum(" + rate(split, 'choice="disagg"') + ")"
    pools = sel('role=~"prefill|decode"')
    d.row(
        "Disaggregation",
        Panel("Disaggregation decisions", "Where prompts are computed, per second: disagg (a "
              "prefill worker, then a hand-off) or decode-only, by reason: headroom (both "
              "options meet the request's SLOs, this one by more), saturated (only this one "
              "meets them), both-miss, cold-start (no measured pace yet), no-prefill; and "
              "requests shed for a predicted TTFT far past their SLO (--slo-shed-factor).",
              "ops",
              (Target(f"sum by (choice, reason) ({rate(split)})", "{{choice}} {{reason}}"),
               Target(f"sum({rate('tandem_router_slo_shed_total')})", "shed"))),
        Panel("Disaggregated share", "Share of requests whose prompt is computed on a prefill "
              "worker and handed over.", "percentunit",
              (Target(ratio(disagg_rate, f"sum({rate(split)})"), "disagg"),)),
        Panel("Planned pools", "Workers the routers' pool planner says the recent traffic "
              "needs, by role (summed over routers), beside the live members.", "short",
              (Target(f"sum(tandem_planner_prefill_workers{{{sel()}}})", "prefill planned"),
               Target(f"sum(tandem_planner_decode_workers{{{sel()}}})", "decode planned"),
               Target(f"max by (role) (tandem_router_members{{{pools}}})", "{{role}} live"))),
    )  # fmt: skip
    d.row(
        "Members and etcd",
        Panel("Live members", "Members in the routers' view, by role (the largest view).",
              "short", (Target(f"max by (role) (tandem_router_members{{{sel()}}})",
                               "{{role}}"),)),
        Panel("etcd errors", "Failed etcd operations per second (retried), by component and "
              "operation.", "ops",
              (Target(f"sum by (component, op) ({rate('tandem_etcd_errors_total')})",
                      "{{component}} {{op}}"),)),
    )  # fmt: skip
    return d


def tenants() -> Dashboard:
    d = Dashboard("tandem-tenants", "Tandem / Tenants",
                  "Tokens, errors and latency per tenant (API key).")  # fmt: skip
    by_tenant = f"sum by (tenant) ({rate(REQS)})"
    errors = "sum by (tenant) (" + rate(REQS, 'status=~"[45].."') + ")"
    d.row(
        "Tenants",
        Panel("Input tokens per tenant", "Prompt tokens per second, by tenant.", TOK,
              (Target(f"sum by (tenant) ({rate('tandem_gateway_input_tokens_total')})",
                      "{{tenant}}"),)),
        Panel("Output tokens per tenant", "Generated tokens per second, by tenant.", TOK,
              (Target(f"sum by (tenant) ({rate('tandem_gateway_output_tokens_total')})",
                      "{{tenant}}"),)),
        Panel("Requests per tenant", "HTTP requests per second, by tenant.", "reqps",
              (Target(by_tenant, "{{tenant}}"),)),
        Panel("Error ratio per tenant", "Share of each tenant's requests answered 4xx or 5xx.",
              "percentunit", (Target(ratio(zero_if_none(errors, by_tenant), by_tenant),
                                     "{{tenant}}"),)),
        Panel("End-to-end latency per tenant", "p50 and p99 of finished requests, by tenant.",
              "s", (Target(quantile(0.5, "tandem_gateway_e2e_request_latency_seconds", "tenant"),
                           "p50 {{tenant}}"),
                    Target(quantile(0.99, "tandem_gateway_e2e_request_latency_seconds",
                                    "tenant"), "p99 {{tenant}}")), width=24),
    )  # fmt: skip
    return d


DASHBOARDS = {"overview": overview, "pools": pools, "kv": kv, "router": router,
              "tenants": tenants}  # fmt: skip


def render() -> dict[str, str]:
    """file name -> JSON text of every dashboard."""
    return {
        f"tandem-{name}.json": json.dumps(build().to_json(), indent=2, sort_keys=True) + "\n"
        for name, build in DASHBOARDS.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the files are stale")
    args = p.parse_args(argv)
    files = render()
    if args.check:
        stale = [n for n, text in files.items() if not (OUT / n).is_file()
                 or (OUT / n).read_text() != text]  # fmt: skip
        extra = sorted({f.name for f in OUT.glob("*.json")} - set(files))
        if stale or extra:
            print(f"stale dashboards: {stale + extra}; run python helm/generate_dashboards.py")
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(files)} dashboards to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
