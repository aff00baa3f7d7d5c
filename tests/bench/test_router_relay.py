"""``bench.router_relay`` for real, briefly: a real etcd, a real router process and the
stand-in decode worker; every stream's tokens reach the client in order, whole, and the report's
figures are sane."""

from __future__ import annotations

import json
import math

import pytest

from bench.relay_http import token_script
from bench.relay_report import pct
from bench.router_relay import main


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100..1, unsorted on purpose
    assert (pct(values, 0.5), pct(values, 0.9), pct(values, 0.99), pct(values, 1.0)) == (
        50.0, 90.0, 99.0, 100.0,
    )  # fmt: skip
    assert pct([7.0], 0.99) == 7.0
    assert math.isnan(pct([], 0.5))


@pytest.mark.parametrize("path", ["relay", "direct"])
def test_short_run_relays_every_token_in_order(smol_dir, tmp_path, path) -> None:
    out = tmp_path / "relay.json"
    r = main([
        "--streams", "4", "--step-ms", "10", "--tokens", "20", "--seconds", "2", "--warmup", "0.5",
        "--idle-seconds", "1", "--idle-probes", "5", "--probe-every", "0.25",
        "--model-dir", str(smol_dir), "--out", str(out), "--token-path", path,
    ])  # fmt: skip
    assert r["config"]["token_path"] == path
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert r["order_errors"] == [] and r["stream_errors"] == []
    assert r["router_alive"]
    # 4 streams of 20 tokens at 10 ms: a stream lasts ~0.2 s, so about 40 end in 2 s (fewer
    # when the shared machine is busy, never none).
    assert r["streams_done"] >= 4
    assert 0 < r["tokens_per_s"] <= r["offered_tokens_per_s"] * 1.1
    if path == "relay":  # the router handles every token
        assert r["router_cores"] > r["router_idle_cores"] >= 0
        assert 0 < r["router_us_per_token"] < 100_000
    else:  # the router sees a stream's start and end only
        assert r["router_us_per_token"] < 100_000
    assert r["probes"]["idle"] == 5 and r["probes"]["loaded"] >= 2
    for key in ("probe_ttft_idle_ms", "probe_ttft_loaded_ms"):
        p50, p90, p99 = r[key].values()
        assert 0 < p50 <= p90 <= p99 < 10_000
    for key in ("probe_path_idle_ms", "probe_path_loaded_ms"):
        p50, _, p99 = r[key].values()
        assert 0 < p50 <= p99  # the TTFT less the stand-in's wait for its tick
        assert r[key]["p50"] <= r[key.replace("path", "ttft")]["p50"]
    gap50, gap99 = r["gap_ms"].values()
    assert 5 <= gap50 <= gap99  # one event per stream per 10 ms step
    assert r["commit"] and r["command"].startswith("python -m bench.router_relay")
    assert r["machine"]["nproc"] >= 1 and len(r["machine"]["loadavg_before"]) == 3


def test_short_run_through_a_gateway_delivers_every_streams_text(smol_dir, tmp_path) -> None:
    r = main([
        "--gateway", "--streams", "4", "--step-ms", "10", "--tokens", "20", "--seconds", "2",
        "--warmup", "0.5", "--idle-seconds", "1", "--idle-probes", "3", "--probe-every", "0.25",
        "--tokens-per-step", "2", "--model-dir", str(smol_dir), "--out", str(tmp_path / "g.json"),
    ])  # fmt: skip
    assert r["config"]["gateway"] and r["config"]["tokens_per_step"] == 2
    # Every stream's text arrived whole (the real tokens' text) with its usage.
    assert r["order_errors"] == [] and r["stream_errors"] == []
    assert r["gateway_alive"] and r["router_alive"] and r["streams_done"] >= 4
    assert r["tokens_per_event"] == 2.0  # one chunk per event of two tokens
    assert r["gateway_cores"] > r["gateway_idle_cores"] >= 0
    assert 0 < r["gateway_us_per_token"] < 100_000
    assert r["probes"]["idle"] == 3 and 0 < r["probe_ttft_loaded_ms"]["p50"] < 10_000


def test_token_script_is_the_models_text_token_by_token(smol_dir) -> None:
    from engine.tokenizer import Tokenizer

    script = token_script(str(smol_dir), 64)
    ids, texts = [t for t, _ in script], [x for _, x in script]
    assert len(script) == 64 and all(texts)
    assert "".join(texts) == Tokenizer(smol_dir).decode(ids, skip_special_tokens=False)
