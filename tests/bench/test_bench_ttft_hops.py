"""`bench.ttft_hops`: a request's TTFT, hop by hop, from the spans of a stack's processes."""

from __future__ import annotations

import json

import pytest

from bench import ttft_hops
from bench.ttft_hops import GENERATE, PREFILL, ROUTE

MS = 1_000_000  # ns


def _span(trace, sid, parent, name, start, end, **events):
    return {
        "trace_id": trace, "span_id": sid, "parent_id": parent, "name": name,
        "start_ns": start * MS, "end_ns": end * MS,
        "events": {k: v * MS for k, v in events.items()},
    }  # fmt: skip


def _request(trace, t0, route_first, generate_start, generate_first, first_token, prefill=None):
    spans = [
        _span(
            trace,
            "g",
            "",
            "POST /v1/chat/completions",
            t0,
            t0 + 500,
            prepared=t0 + 1,
            first_token=first_token,
        ),  # fmt: skip
        _span(trace, "r", "g", ROUTE, t0 + 2, t0 + 499, first_response=route_first),
        _span(trace, "d", "r", GENERATE, generate_start, t0 + 498, first_response=generate_first),
    ]
    if prefill is not None:
        spans.append(_span(trace, "p", "r", PREFILL, *prefill))
    return spans


def test_hops_are_means_from_the_gateway_s_arrival():
    spans = [
        *_request("t1", 1000, 1003, 1004, 1050, 1052),
        *_request("t2", 2000, 2005, 2006, 2070, 2072, prefill=(2003, 2040)),
        # No first token (an error, an embedding): not a generation, left out.
        _span("t3", "g", "", "POST /v1/chat/completions", 3000, 3001),
        # A worker's span whose gateway span is not in this window: left out.
        _span("t4", "d", "r", GENERATE, 4000, 4100, first_response=4050),
    ]
    hops = ttft_hops.hops(spans)
    assert hops["requests"] == 2
    assert (hops["prepared"], hops["at route"]) == (pytest.approx(1), pytest.approx(2))
    assert hops["route's first"] == pytest.approx((3 + 5) / 2)
    assert hops["at generate"] == pytest.approx((4 + 6) / 2)
    assert hops["generate's first"] == pytest.approx((50 + 70) / 2)
    assert hops["first token"] == pytest.approx((52 + 72) / 2)
    assert (hops["at prefill"], hops["prefill done"]) == (pytest.approx(3), pytest.approx(40))
    assert ttft_hops.hops(spans[-2:]) == {}  # no request to average
    table = ttft_hops.render([("colocated:1", "mixed", "4", hops)])
    assert (
        "| colocated:1 | mixed | 4 | 2 | 1.0 | 2.0 | 4.0 | 3.0 | 40.0 | 5.0 | 60.0 | 62.0 |"
        in table
    )
    colocated = {k: v for k, v in hops.items() if "prefill" not in k}  # no prefill worker
    assert "prefill" not in ttft_hops.render([("colocated:1", "mixed", "4", colocated)])


def test_a_migrated_request_counts_its_first_decode_call(tmp_path):
    spans = _request("t1", 0, 3, 4, 50, 52)
    spans.append(_span("t1", "d2", "r", GENERATE, 200, 400, first_response=210))  # after a move
    assert ttft_hops.hops(spans)["at generate"] == pytest.approx(4)


def test_new_spans_reads_only_what_a_run_appended(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    old, new = _request("t1", 0, 3, 4, 50, 52), _request("t2", 1000, 1003, 1004, 1050, 1052)
    (traces / "gateway.jsonl").write_text("".join(json.dumps(s) + "\n" for s in old))
    since = ttft_hops.offsets(tmp_path)
    with (traces / "gateway.jsonl").open("a") as f:
        f.write("".join(json.dumps(s) + "\n" for s in new) + '{"half a line')
    (traces / "router.jsonl").write_text(json.dumps(old[0]) + "\n")  # a file new since then
    got = ttft_hops.new_spans(tmp_path, since)
    assert [s["trace_id"] for s in got] == ["t2"] * 3 + ["t1"]
    assert ttft_hops.offsets(tmp_path / "nothing") == {}
