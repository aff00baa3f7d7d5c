"""bench.traces and bench.trace_workload: both formats from real rows (tests/data/traces), the
replayed slice (time scaling, start, caps), the trace's own sharing, and prompts whose blocks
are byte-identical exactly where the trace's block ids are equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.trace_workload import BlockTexts, TraceConfig, generate_trace
from bench.traces import (
    BLOCK_TOKENS,
    TraceRow,
    detect_format,
    load_trace,
    select,
    sharing,
)
from bench.workloads import ApproxCounter, TokenizerCounter

DATA = Path(__file__).parents[1] / "data" / "traces"
MOONCAKE, CONV, CODE = (
    DATA / "mooncake_sample.jsonl", DATA / "azure_conv_sample.csv", DATA / "azure_code_sample.csv"
)  # fmt: skip
SHARED_START = 1017.4  # from here on, the Mooncake sample's rows share leading blocks


@pytest.fixture(scope="module")
def counter(smol_dir) -> TokenizerCounter:
    return TokenizerCounter(smol_dir)


def row(t: float, n: int, ids: tuple[int, ...], out: int = 4) -> TraceRow:
    return TraceRow(t, n, out, ids)


def test_mooncake_rows():
    rows = load_trace(MOONCAKE)
    assert detect_format(MOONCAKE) == "mooncake" and len(rows) == 26
    first = rows[0]
    assert first.time == 0 and (first.input_tokens, first.output_tokens) == (40160, 6)
    assert first.hash_ids == tuple(range(79))  # 78 full blocks and one of 224 tokens
    assert rows[2].time == pytest.approx(0.040)  # milliseconds -> seconds
    assert rows[-1].time == pytest.approx(1022.025) and rows[-1].hash_ids[-1] == 43923
    for r in rows:
        assert len(r.hash_ids) == -(-r.input_tokens // BLOCK_TOKENS)
    last, other = rows[-1].hash_ids, rows[-4].hash_ids  # 18,440 and 18,458 tokens
    assert last[:35] == other[:35] and last[35] != other[35]


@pytest.mark.parametrize(
    "path, first, gap",
    [(CONV, (374, 44), 4.3145790), (CODE, (4808, 10), 0.0520)],
)
def test_azure_rows(path, first, gap):
    rows = load_trace(path)
    assert detect_format(path) == "azure" and len(rows) == 12
    assert (rows[0].input_tokens, rows[0].output_tokens) == first
    assert rows[0].time == 0 and rows[1].time == pytest.approx(gap, abs=1e-6)
    ids = [h for r in rows for h in r.hash_ids]
    assert len(ids) == len(set(ids))  # no content: no row shares a block with another
    assert all(len(r.hash_ids) == -(-r.input_tokens // BLOCK_TOKENS) for r in rows)


def test_files_that_are_not_traces_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1,
                               "hash_ids": [1]}) + "\n")  # fmt: skip
    with pytest.raises(ValueError, match="1 hash_ids for 600 tokens"):
        load_trace(bad)
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a trace"):
        load_trace(other)
    assert load_trace(CONV, "azure") == load_trace(CONV)


def test_speed_start_and_count():
    rows = load_trace(MOONCAKE)
    sel = select(rows, 4)
    assert sel.arrivals == pytest.approx((0.0, 0.0, 0.040, 0.277)) and sel.scanned == 4
    fast = select(rows, 4, speed=2.0)
    assert fast.arrivals == pytest.approx((0.0, 0.0, 0.020, 0.1385))
    late = select(rows, 3, start=SHARED_START)
    assert [r.time for r in late.rows] == pytest.approx([1017.436, 1017.786, 1017.964])
    assert late.arrivals == pytest.approx((0.0, 0.350, 0.528))  # from the first replayed
    assert len(select(rows, 1000).rows) == 26  # the cap is the trace's end
    with pytest.raises(ValueError):
        select(rows, 3, speed=0)


def test_length_caps_cut_or_skip():
    rows = [row(0, 1500, (1, 2, 3), out=900), row(1, 300, (4,)), row(2, 2000, (1, 2, 3, 5))]
    cut = select(rows, 3, max_input=600, max_output=100)
    assert [(r.input_tokens, r.hash_ids) for r in cut.rows] == [
        (600, (1, 2)), (300, (4,)), (600, (1, 2))
    ]  # fmt: skip
    assert [r.output_tokens for r in cut.rows] == [100, 4, 4] and (cut.cut, cut.skipped) == (2, 0)
    assert cut.original == tuple(rows)
    skip = select(rows, 1, max_input=600, overlong="skip")
    assert skip.rows == (row(1, 300, (4,)),) and (skip.skipped, skip.scanned) == (1, 2)
    assert skip.arrivals == (0.0,)


def test_sharing_counts_leading_blocks_seen_before():
    rows = [
        row(0, 1100, (1, 2, 3)),  # 512 + 512 + 76
        row(1, 1200, (1, 2, 3)),  # block 3 seen with 76 of its 176 tokens: 1024 + 76 reused
        row(2, 600, (1, 9)),  # 512 reused
        row(3, 512, (9,)),  # id 9 at the front: an earlier request had 88 of its tokens
        row(4, 700, (7, 2)),  # 2 seen, but not as a prefix: nothing reused
    ]
    s = sharing(rows)
    assert s.prompt_tokens == 4112 and s.reused_tokens == 1100 + 512 + 88
    assert (s.blocks, s.unique_blocks) == (11, 5)
    assert s.reuse == pytest.approx(1700 / 4112)


def test_equal_ids_are_identical_blocks(counter):
    texts = BlockTexts(0, counter)
    a, b = texts.full(7, False), texts.full(8, False)
    assert a == BlockTexts(0, counter).full(7, False) and a != b  # seeded by id, not by order
    assert a.startswith(" ") and not texts.full(7, True).startswith(" ")  # no lead in front
    assert a != BlockTexts(1, counter).full(7, False)  # another seed: fresh text
    assert counter.count(a) == counter.count(b) == BLOCK_TOKENS
    part = texts.text(7, False, 100)  # a partial block: the block's first tokens
    assert counter.count(part) == 100 and a.startswith(part)
    # Two prompts with the same two leading ids: the same 1,024 leading tokens, byte for byte.
    p = texts.prompt(row(0, 1300, (1, 2, 3)))
    q = texts.prompt(row(0, 1100, (1, 2, 4)))
    head = texts.full(1, True) + texts.full(2, False)
    assert p.startswith(head) and q.startswith(head) and p[len(head) :] != q[len(head) :]
    tok = counter._tok
    ids_p, ids_q = (tok.encode(x, add_special_tokens=False).ids for x in (p, q))
    assert len(ids_p) == 1300 and len(ids_q) == 1100
    assert ids_p[:1024] == ids_q[:1024] and ids_p[1024] != ids_q[1024]
    # Blocks tokenize the same alone as inside a prompt: the prompt is its blocks end to end.
    blocks = [texts.full(1, True), texts.full(2, False), texts.text(3, False, 276)]
    assert ids_p == [i for t in blocks for i in tok.encode(t, add_special_tokens=False).ids]


def test_chat_template_keeps_the_shared_prefix(counter, smol_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smol_dir)
    texts = BlockTexts(0, counter)
    chats = [
        tok.encode_chat([{"role": "user", "content": texts.prompt(row(0, 1000, ids))}])
        for ids in ((1, 2), (1, 3))
    ]
    header = next(i for i, (x, y) in enumerate(zip(*chats, strict=False)) if x != y)
    assert header >= 512 and header - 512 < 40  # the template's header, then block 1
    assert len(chats[0]) == len(chats[1]) == header - 512 + 1000 + 6  # and its tail


def test_generated_replay_is_exact_and_reproducible(counter):
    cfg = TraceConfig(str(MOONCAKE), 8, start=SHARED_START, speed=2.0, max_input_len=600)
    w = generate_trace(cfg, counter)
    assert w == generate_trace(cfg, counter) and w.name == "trace:mooncake_sample"
    assert w.exact_lengths and len(w.units) == 8 and all(len(u) == 1 for u in w.units)
    assert [r.input_tokens for r in w.requests] == [600] * 8
    for r in w.requests:
        assert counter.count(r.messages[0].content) == 600
    assert w.arrivals == pytest.approx((0.0, 0.175, 0.264, 0.647, 0.688, 1.1375, 1.4405, 1.688))
    # rows 2 and 3 of the slice have the same ids (42799, 42800, ...): the same cut prompt
    prompts = [r.messages[0].content for r in w.requests]
    assert prompts[1] == prompts[2] and len(set(prompts)) == 6
    t = w.trace
    assert (t.requests, t.cut, t.skipped, t.format) == (8, 8, 0, "mooncake")
    assert (t.input_tokens, t.reused_tokens, t.reuse) == (4800, 1200, 0.25)
    assert t.span_s == pytest.approx(1.688) and t.exact_prompts and t.inexact_prompts == 0
    other = generate_trace(TraceConfig(str(MOONCAKE), 8, seed=1, start=SHARED_START,
                                       max_input_len=600), counter)  # fmt: skip
    assert not {r.messages for r in other.requests} & {r.messages for r in w.requests}


def test_azure_replay_without_a_tokenizer():
    w = generate_trace(TraceConfig(str(CODE), 5, max_input_len=1000, overlong="skip"),
                       ApproxCounter())  # fmt: skip
    assert (
        not w.exact_lengths and (w.trace.skipped, w.trace.scanned) == (5, 10) and w.trace.reuse == 0
    )
    assert [r.input_tokens for r in w.requests] == [110, 34, 374, 34, 201]
    assert len({r.messages for r in w.requests}) == 5
    assert w == generate_trace(w.config, ApproxCounter())


def test_azure_replay_from_the_command_line_scales_time_and_caps_requests():
    """``tandem bench --trace azure.csv --trace-speed 4 --num-requests 5 --send-slo``: the first
    5 rows' lengths, their arrivals a quarter as far apart, fresh prompts per rate, and the SLOs
    in every request's body."""
    import argparse

    from bench.cli_args import add_arguments
    from bench.runner import RequestOptions
    from bench.sweep import load_config, workload_sweeps

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--trace", str(CONV), "--trace-speed", "4", "--num-requests", "5",
                         "--tokenizer", "none", "--send-slo", "--slo-tpot-ms", "15"])  # fmt: skip
    (sweep,) = workload_sweeps(args, 2)
    rows = load_trace(CONV)[:5]
    for w in sweep:
        assert [r.input_tokens for r in w.requests] == [r.input_tokens for r in rows]
        assert [r.output_tokens for r in w.requests] == [r.output_tokens for r in rows]
        assert w.arrivals == pytest.approx([r.time / 4 for r in rows])
    assert {r.messages for r in sweep[0].requests}.isdisjoint(r.messages for r in sweep[1].requests)
    load = load_config(args, [], 0, sweep[0])
    assert load.trace_speed == 4 and load.rate == float("inf")
    opts = RequestOptions(slo_ms=(args.slo_ttft_ms, args.slo_tpot_ms) if args.send_slo else None)
    assert opts.extra_body() == {"ignore_eos": True, "slo_ttft_ms": 1000.0, "slo_tpot_ms": 15.0}
