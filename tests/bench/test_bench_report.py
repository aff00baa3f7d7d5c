"""bench report, stack specs and the CLI wiring, on synthetic runs (no servers)."""

from __future__ import annotations

import json
import math

import pytest

from bench.metrics import SLO, record_from_trace, summarize
from bench.report import (
    RunReport,
    render_ratios,
    render_table,
    to_json,
    write_json,
    write_markdown,
    write_plots,
)
from bench.rescore import load_reports
from bench.runner import LoadConfig, RunResult
from bench.stacks import StackSpec, parse_stack, stack_config
from cli.main import build_parser
from services.launcher.stack import COLOCATED_THRESHOLD, StackConfig

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(endpoint: str, scale: float, rate: float = math.inf) -> RunReport:
    records = [
        record_from_trace(
            f"r{i}",
            0.0,
            i * 0.1,
            [i * 0.1 + scale * 0.5, i * 0.1 + scale * 0.53],
            i * 0.1 + scale * 0.56,
            input_tokens=10,
            output_tokens=3,
        )  # fmt: skip
        for i in range(4)
    ]
    records.append(record_from_trace("bad", 0.0, 0.0, [], 0.1, 10, 0, error="boom"))
    result = RunResult(endpoint, "decode-heavy", rate, None, 2.0, records)
    return RunReport(result, summarize(records, 2.0, SLO()))


def test_table_and_ratios():
    fast, slow = fake_run("disagg:1p1d", 1.0), fake_run("colocated:2", 2.0)
    table = render_table([fast, slow])
    assert "| disagg:1p1d | decode-heavy | inf | 4/5 | 2.00 |" in table
    assert "| 500/500/500 | 30/30/30 |" in table  # TTFT and TPOT in ms
    ratios = render_ratios([fast, slow])
    assert ratios is not None and "| colocated:2 | decode-heavy | inf | 0.00x |" in ratios
    assert "| 2.00x | 2.00x | 2.00x | 2.00x | 2.00x |" in ratios  # latencies doubled
    assert render_ratios([fast]) is None


def test_json_is_strict_and_complete(tmp_path):
    reports = [fake_run("a", 1.0, rate=1.0), fake_run("a", 1.0)]
    path = tmp_path / "r.json"
    write_json(path, {"date": "now", "slo": {"ttft": 1.0, "tpot": 0.05}}, reports)

    def no_nan(x):
        raise ValueError(x)

    data = json.loads(path.read_text(), parse_constant=no_nan)
    assert [run["rate"] for run in data["runs"]] == [1.0, "inf"]
    recs = data["runs"][0]["records"]
    assert len(recs) == 5 and recs[-1]["ok"] is False and recs[-1]["ttft"] is None
    assert recs[0]["tpot"] == pytest.approx(0.03) and len(recs[0]["itl"]) == 1
    assert data["runs"][0]["summary"]["goodput"] == 2.0


def test_plots_are_pngs(tmp_path):
    reports = [fake_run(n, s, r) for n, s in (("a", 1.0), ("b", 2.0)) for r in (1.0, 2.0)]
    for path in write_plots(tmp_path, reports):
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_stack_specs():
    assert parse_stack("disagg:1p2d") == StackSpec("disagg:1p2d", 1, 2)
    assert parse_stack("disagg:2p1d:threshold=0").threshold == 0
    assert parse_stack("colocated:2") == StackSpec("colocated:2", 0, 2, colocated=True)
    for bad in ("colocated:0", "disagg:0p1d", "disagg:1p", "mixed:2"):
        with pytest.raises(ValueError):
            parse_stack(bad)
    cfg = stack_config(parse_stack("colocated:2"), "/m", "/r", kv_cache_bytes=1 << 20)
    assert (cfg.num_prefill, cfg.num_decode, cfg.kv_cache_bytes) == (0, 2, 1 << 20)
    assert cfg.decode_only_threshold == COLOCATED_THRESHOLD and cfg.topology == "colocated:2"
    cfg = stack_config(parse_stack("disagg:1p1d:threshold=0"), "/m", "/r")
    assert cfg.decode_only_threshold == 0 and cfg.topology == "disagg:1p1d"


def test_stack_specs_set_the_step_budget_and_the_disagg_mode_per_stack():
    spec = parse_stack("colocated:1:tokens=512")
    assert (spec.colocated, spec.tokens, spec.name) == (True, 512, "colocated:1:tokens=512")
    # The stack's own budget wins over the run's (--max-num-batched-tokens 2048 here).
    cfg = stack_config(spec, "/m", "/r", max_num_batched_tokens=2048)
    assert cfg.max_num_batched_tokens == 512 and cfg.topology == "colocated:1"
    assert stack_config(parse_stack("colocated:1"), "/m", "/r", max_num_batched_tokens=2048
                        ).max_num_batched_tokens == 2048  # fmt: skip
    cfg = stack_config(parse_stack("disagg:1p1d:mode=length:tokens=1024"), "/m", "/r")
    assert (cfg.disagg_mode, cfg.max_num_batched_tokens) == ("length", 1024)
    assert stack_config(parse_stack("disagg:1p1d"), "/m", "/r").disagg_mode == ""
    for bad in ("colocated:1:tokens=0", "colocated:1:mode=slo", "disagg:1p1d:mode=fast",
                "colocated:1:tokens=x"):  # fmt: skip
        with pytest.raises(ValueError):
            parse_stack(bad)


def test_colocated_config_and_cli_flags():
    cfg = StackConfig.colocated(3, model_dir="/m", run_dir="/r")
    assert (cfg.num_prefill, cfg.num_decode, cfg.topology) == (0, 3, "colocated:3")
    args = build_parser().parse_args(["serve", "--colocated", "2"])
    assert args.colocated == 2
    args = build_parser().parse_args(
        ["bench", "--stack", "disagg:1p1d", "--stack", "colocated:2", "--rate", "1,2",
         "--rate", "inf", "--workload", "prefill-heavy", "--slo-tpot-ms", "80"]
    )  # fmt: skip
    assert args.stack == ["disagg:1p1d", "colocated:2"] and args.workload == ["prefill-heavy"]
    assert [r for g in args.rate for r in g] == [1.0, 2.0, math.inf]
    assert args.slo_tpot_ms == 80 and args.func.__name__ == "_bench"


def test_rescore_round_trips_records(tmp_path):
    reports = [fake_run("a", 1.0), fake_run("b", 2.0, rate=0.5)]
    path = tmp_path / "results.json"
    write_json(path, {"date": "now"}, reports)
    same = load_reports(path, SLO())
    assert [r.result.records for r in same] == [r.result.records for r in reports]
    assert [r.summary for r in same] == [r.summary for r in reports]
    relaxed = load_reports(path, SLO(ttft=2.0, tpot=0.1))
    assert [r.summary.goodput for r in relaxed] == [2.0, 2.0]  # "b" now meets the SLOs
    assert relaxed[1].result.rate == 0.5 and math.isinf(relaxed[0].result.rate)


def test_each_rate_of_a_sweep_gets_fresh_requests():
    from bench.sweep import workload_sweeps

    args = build_parser().parse_args(
        ["bench", "--rate", "1,2", "--workload", "decode-heavy:output=4", "--workload",
         "random", "--num-requests", "3", "--tokenizer", "none"]
    )  # fmt: skip
    sets = workload_sweeps(args, 2)
    assert [[w.name for w in sweep] for sweep in sets] == [["decode-heavy"] * 2, ["random"] * 2]
    assert [w.config.seed for w in sets[0]] == [0, 1]
    first, second = (set(r.messages for r in w.requests) for w in sets[0])
    assert not first & second  # no prompt is sent twice to a stack
    assert workload_sweeps(args, 2) == sets  # and every target gets the same ones


TRACE = "tests/data/traces/mooncake_sample.jsonl"


def test_trace_workloads_rates_and_results(tmp_path):
    from bench.sweep import load_config, run_meta, workload_sweeps

    argv = ["bench", "--trace", TRACE, "--trace-start", "1017.4", "--num-requests", "8",
            "--max-input-len", "600", "--trace-speed", "4", "--tokenizer", "none"]  # fmt: skip
    args = build_parser().parse_args(argv)
    (sweep,) = workload_sweeps(args, 1)  # only the trace: no default workload beside it
    load = load_config(args, [], 0, sweep[0])
    assert load.trace_speed == 4.0 and sweep[0].arrivals[-1] == pytest.approx(3.376 / 4)
    args = build_parser().parse_args([*argv, "--rate", "2,8", "--workload", "random"])
    rnd, trace = workload_sweeps(args, 2)
    assert [w.name for w in trace] == ["trace:mooncake_sample"] * 2
    assert [w.config.seed for w in trace] == [0, 1]  # fresh text at each rate
    assert not {r.messages for r in trace[0].requests} & {r.messages for r in trace[1].requests}
    # --rate replaces the times
    assert load_config(args, [2.0, 8.0], 1, trace[1]) == LoadConfig(8.0)
    meta = {**run_meta(args, "cmd", [rnd[0], trace[0]], SLO()), "loadavg_end": [0, 0, 0]}
    (info,) = [w for w in meta["workloads"] if "trace" in w]
    assert info["path"] == TRACE and info["trace"]["reuse"] == 0.25
    assert info["trace"]["cut"] == 8 and info["trace"]["overlong"] == "cut"
    rep = fake_run("a", 1.0)
    rep.result.trace_speed = 4.0
    assert rep.rate_label == "trace x4"
    write_json(tmp_path / "r.json", meta, [rep])
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["trace_speed"] == 4.0
    assert load_reports(tmp_path / "r.json", SLO())[0].rate_label == "trace x4"
    write_markdown(tmp_path / "r.md", meta, [rep])
    md = (tmp_path / "r.md").read_text()
    assert "| trace:mooncake_sample | mooncake_sample.jsonl (mooncake) | 8 | 1017.4 | 4 |" in md
    assert "| 4800 | 8 cut to 600 | 25.0% (25.3%) | 16 (12) | no (no tokenizer) |" in md


def test_gpu_busy_and_cpu_cores_are_reported_per_run(tmp_path) -> None:
    import dataclasses

    from bench.gpu_busy import GpuBusy
    from bench.report import render_resources

    plain = fake_run("vllm", 1.0)
    assert render_resources([plain]) is None  # nothing measured: no table
    busy = GpuBusy({0: [90.0, 95.0, 40.0, 100.0]}, {0: [0.0, 0.1, 0.2, 0.3]})
    rep = dataclasses.replace(fake_run("tandem", 1.0), gpu_busy=busy, cpu={"decode-0/engine": 1.0})
    table = render_resources([plain, rep])
    assert table is not None and "tandem" in table and "vllm" not in table
    assert "81% / " in table and "decode-0/engine 1.00" in table
    doc = to_json({}, [rep])["runs"][0]
    assert doc["gpu_busy"]["mean"] == 81.25 and doc["cpu_cores"] == {"decode-0/engine": 1.0}


def test_stack_specs_set_the_gateways_token_path():
    """``:path=relay`` runs the stack's gateway with the router relaying tokens; by default
    (or ``:path=direct``) it streams them from the decode worker."""
    cfg = stack_config(parse_stack("colocated:1:path=relay"), "/m", "/r")
    assert cfg.gateway_args == ("--token-path", "relay") and cfg.topology == "colocated:1"
    cfg = stack_config(parse_stack("disagg:1p1d:path=direct:mode=length"), "/m", "/r")
    assert (cfg.gateway_args, cfg.disagg_mode) == (("--token-path", "direct"), "length")
    assert stack_config(parse_stack("disagg:1p1d"), "/m", "/r").gateway_args == ()
    with pytest.raises(ValueError, match="unknown path"):
        parse_stack("colocated:1:path=fast")


def test_stack_specs_set_the_workers_mixed_graphs():
    """``:graphs=N`` passes ``--mixed-graph-max-tokens N`` to the stack's workers (0: eager
    mixed steps), after the run's own worker flags; by default the workers keep theirs."""
    spec = parse_stack("colocated:1:graphs=0")
    cfg = stack_config(spec, "/m", "/r", worker_args=("--seed", "1"))
    assert cfg.worker_args == ("--seed", "1", "--mixed-graph-max-tokens", "0")
    cfg = stack_config(parse_stack("disagg:1p1d:graphs=256:path=relay"), "/m", "/r")
    assert cfg.worker_args == ("--mixed-graph-max-tokens", "256")
    assert stack_config(parse_stack("colocated:1"), "/m", "/r").worker_args == ()
    with pytest.raises(ValueError, match="graphs must be >= 0"):
        parse_stack("colocated:1:graphs=-1")


def test_stack_specs_size_the_workers_host_tier():
    """``:host=GIB`` passes ``--kv-host-cache-gib GIB`` to the workers (0: no host tier)."""
    cfg = stack_config(parse_stack("colocated:1:graphs=0:host=0"), "/m", "/r")
    assert cfg.worker_args == ("--mixed-graph-max-tokens", "0", "--kv-host-cache-gib", "0")
    assert stack_config(parse_stack("disagg:1p1d:host=4"), "/m", "/r").worker_args == (
        "--kv-host-cache-gib", "4",
    )  # fmt: skip
    with pytest.raises(ValueError, match="host must be >= 0"):
        parse_stack("colocated:1:host=-1")


def test_stack_specs_set_the_workers_spread_graphs():
    """``:spread=0|1`` passes ``--[no-]decode-spread-graphs`` to the workers; by default nothing
    (their default, on)."""
    cfg = stack_config(parse_stack("colocated:1:host=0:spread=1"), "/m", "/r")
    assert cfg.worker_args == ("--kv-host-cache-gib", "0", "--decode-spread-graphs")
    assert (
        "--no-decode-spread-graphs"
        in stack_config(parse_stack("disagg:1p1d:spread=0"), "/m", "/r").worker_args
    )
    assert stack_config(parse_stack("colocated:1"), "/m", "/r").worker_args == ()


def test_stack_specs_set_the_workers_stream_interval():
    """``:interval=N`` passes ``--stream-interval N`` to the workers (N >= 1)."""
    assert stack_config(parse_stack("disagg:1p1d:interval=4"), "/m", "/r").worker_args == (
        "--stream-interval", "4",
    )  # fmt: skip
    with pytest.raises(ValueError, match="interval must be >= 1"):
        parse_stack("colocated:1:interval=0")


def test_stack_specs_turn_on_every_process_s_trace_file():
    """``:traces=1`` has the launcher give every process a trace file; by default none."""
    assert stack_config(parse_stack("colocated:1:traces=1"), "/m", "/r").trace_files is True
    assert stack_config(parse_stack("disagg:1p1d:traces=1"), "/m", "/r").trace_files is True
    assert stack_config(parse_stack("colocated:1"), "/m", "/r").trace_files is False
