"""``tandem bench`` for real: it starts the local stack itself (etcd, router, workers and
gateway as processes, the bundled model), drives it with the openai client and writes valid
JSON, markdown and PNG plots."""

from __future__ import annotations

import json

import pytest

from bench.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def no_nan(x):
    raise ValueError(f"not strict JSON: {x}")


def run_bench(out, *args: str) -> dict:
    assert main([*args, "--out", str(out), "--logs", str(out / "logs"), "--no-progress"]) == 0
    data = json.loads((out / "results.json").read_text(), parse_constant=no_nan)
    for name in ("latency_cdf.png", "goodput_vs_rate.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert "| endpoint | workload |" in (out / "results.md").read_text()
    return data


@pytest.mark.stack  # a disaggregated stack of its own (about 25 s): `make test-stack`
def test_short_run_against_a_disaggregated_stack(smol_dir, tmp_path):
    # 300-token prompts are over the router's decode-only threshold (256): prefill worker,
    # KV transfer, then decode.
    data = run_bench(
        tmp_path, "--stack", "disagg:1p1d:traces=1", "--model-dir", str(smol_dir),
        "--workload", "prefill-heavy", "--num-requests", "6", "--input-len", "300",
        "--input-spread", "0", "--output-len", "4", "--output-spread", "0", "--concurrency", "3",
    )  # fmt: skip
    (run,) = data["runs"]
    assert run["endpoint"] == "disagg:1p1d:traces=1" and run["not_sent"] == 0
    assert data["workloads"][0]["exact_lengths"] is True
    recs = run["records"]
    assert len(recs) == 6 and all(r["ok"] for r in recs), [r["error"] for r in recs]
    for r in recs:
        assert r["output_tokens"] == 4  # ignore_eos honoured: exact output length
        assert r["input_tokens"] > 300  # content plus the chat template
        assert 0 < r["ttft"] <= r["e2e"] and r["tpot"] > 0
    s = run["summary"]
    assert s["completed"] == 6 and s["output_tokens"] == 24
    assert s["request_throughput"] == pytest.approx(6 / s["duration"])
    assert (tmp_path / "logs/0-disagg-1p1d-traces=1/logs/prefill-0.log").is_file()
    # Every process's metrics, saved before and after the run.
    saved = tmp_path / "logs/0-disagg-1p1d-traces=1/metrics/prefill-heavy-inf-c=3"
    ttft = "tandem_gateway_time_to_first_token_seconds"
    assert ttft in (saved / "gateway.after.prom").read_text()
    assert "tandem_engine_queue_time_seconds" in (saved / "decode-0.before.prom").read_text()
    cache = run["cache"]  # read from both workers' Stats: every prompt token counted once
    assert cache["workers"] == 2 and cache["prompt_tokens"] >= sum(r["input_tokens"] for r in recs)
    assert 0 <= cache["hit_rate"] <= 1 and cache["location_txns"] > 0
    steps = run["engine_steps"]  # both workers' step histograms: every prompt was computed
    assert steps["prefill"]["steps"] >= 1 and steps["prefill"]["mean_ms"] > 0
    assert steps["decode"]["steps"] >= 3 and 1 <= steps["decode"]["mean_batch"] <= 3
    assert 0 < run["cpu_cores"]["bench client"] < 2  # the load generator's own CPU
    assert run["kernel_compiles_serving"] == 0  # read from the workers (no Triton on a CPU)
    split = run["ttft_split_ms"]  # gateway TTFT holds the engine's part, which holds its queue
    assert split["gateway"] >= split["engine"] >= split["queue"] >= 0
    assert split["services"] == pytest.approx(split["gateway"] - split["engine"])
    hops = run["ttft_hops_ms"]  # from every process's spans: the router, then the prefill worker
    assert hops["requests"] >= 6
    assert 0 < hops["at route"] < hops["at prefill"] < hops["first token"]
    assert hops["prefill done"] > hops["at prefill"]  # it ends once its KV is handed over
    assert hops["at generate"] > hops["at route"] and "generate's first" in hops


@pytest.mark.slow
def test_compare_colocated_stack_with_a_rate_sweep(smol_dir, tmp_path):
    data = run_bench(
        tmp_path, "--stack", "colocated:1", "--stack", "disagg:1p1d", "--model-dir", str(smol_dir),
        "--workload", "decode-heavy", "--workload", "multi-turn", "--turns", "2",
        "--num-requests", "4", "--input-len", "16", "--output-len", "6", "--rate", "2,inf",
    )  # fmt: skip
    runs = data["runs"]
    assert [(r["endpoint"], r["workload"], r["rate"]) for r in runs[:4]] == [
        ("colocated:1", "decode-heavy", 2.0), ("colocated:1", "decode-heavy", "inf"),
        ("colocated:1", "multi-turn", 2.0), ("colocated:1", "multi-turn", "inf"),
    ]  # fmt: skip
    assert len(runs) == 8 and all(r["summary"]["completed"] == 4 for r in runs)
    assert not (tmp_path / "logs/0-colocated-1/logs/prefill-0.log").exists()
    assert "Ratios against `colocated:1`" in (tmp_path / "results.md").read_text()


@pytest.mark.stack  # a disaggregated stack of its own (about 30 s): `make test-stack`
def test_trace_replay_against_a_disaggregated_stack(smol_dir, tmp_path):
    # Eight real Mooncake rows (tests/data/traces) cut to their first 600 tokens: two pairs
    # have the same leading blocks, so the trace itself reuses 1,200 of 4,800 prompt tokens.
    # One in flight at a time, so each repeat finds its twin's blocks cached. The length rule
    # places every prompt the same way (the SLO rule's choice depends on the machine's load and
    # could split twins between the workers' caches); this test is about the trace, not placement.
    data = run_bench(
        tmp_path, "--stack", "disagg:1p1d:mode=length", "--model-dir", str(smol_dir),
        "--trace", "tests/data/traces/mooncake_sample.jsonl", "--trace-start", "1017.4",
        "--num-requests", "8", "--trace-speed", "2", "--max-input-len", "600",
        "--max-output-len", "4", "--concurrency", "1",
    )  # fmt: skip
    (run,) = data["runs"]
    assert run["workload"] == "trace:mooncake_sample" and run["trace_speed"] == 2.0
    (workload,) = data["workloads"]
    trace = workload["trace"]
    assert (trace["requests"], trace["cut"], trace["reused_tokens"]) == (8, 8, 1200)
    assert trace["exact_prompts"] and trace["inexact_prompts"] == 0
    recs = sorted(run["records"], key=lambda r: r["request_id"])
    assert len(recs) == 8 and all(r["ok"] for r in recs), [r["error"] for r in recs]
    assert [r["output_tokens"] for r in recs] == [4, 4, 4, 4, 2, 4, 4, 4]  # the trace's, capped
    assert {r["input_tokens"] for r in recs} == {600 + 30}  # exact content + SmolLM2's template
    assert run["summary"]["duration"] >= 3.376 / 2  # the last arrives at the trace's time
    cache = run["cache"]  # the servers' prefix hits cover what the trace shares
    assert cache["hit_tokens"] >= trace["reused_tokens"]
    assert cache["ideal_hit_rate"] >= trace["reuse"] * 600 / 630
    md = (tmp_path / "results.md").read_text()
    assert "| trace x2 c=1 |" in md and "| 8 cut to 600 | 25.0% (25.3%) |" in md
