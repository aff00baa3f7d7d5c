"""bench.workloads and arrivals: reproducible from a seed, exact lengths with a tokenizer."""

from __future__ import annotations

import random
import statistics

import pytest

from bench.runner import arrival_times
from bench.workloads import (
    KINDS,
    ApproxCounter,
    TokenizerCounter,
    WorkloadConfig,
    generate,
    lognormal_length,
    parse_workload,
)


@pytest.fixture(scope="module")
def counter(smol_dir) -> TokenizerCounter:
    return TokenizerCounter(smol_dir)


def make(kind: str, counter, n: int = 8, seed: int = 0, **kw):
    return generate(WorkloadConfig(kind, n, seed, **kw), counter)


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_requests(kind, counter):
    small = dict(input_len=40, output_len=16, prefix_len=64)
    a, b = make(kind, counter, **small), make(kind, counter, **small)
    assert a == b and len(a.requests) == 8 and a.exact_lengths
    c = make(kind, counter, seed=1, **small)
    assert [r.messages for r in c.requests] != [r.messages for r in a.requests]
    approx = make(kind, ApproxCounter(), **small)
    assert approx == make(kind, ApproxCounter(), **small) and not approx.exact_lengths


def test_exact_uniform_lengths(counter):
    w = make("random", counter, n=20, input_len=100, input_spread=0.5, output_len=30,
             output_spread=0.2)  # fmt: skip
    for r in w.requests:
        (msg,) = r.messages
        assert counter.count(msg.content) == r.input_tokens
        assert 50 <= r.input_tokens <= 150 and 24 <= r.output_tokens <= 36
    assert len({r.messages for r in w.requests}) == 20  # no accidental shared prompts


def test_heavy_mixes(counter):
    pre = make("prefill-heavy", counter)
    dec = make("decode-heavy", counter)
    assert min(r.input_tokens for r in pre.requests) >= 768
    assert max(r.output_tokens for r in pre.requests) <= 20
    assert max(r.input_tokens for r in dec.requests) <= 40
    assert min(r.output_tokens for r in dec.requests) >= 384


def test_shared_prefix(counter):
    w = make("shared-prefix", counter, n=6, prefix_len=200, num_prefixes=2, input_len=20)
    systems = [r.messages[0] for r in w.requests]
    assert all(m.role == "system" for m in systems)
    assert systems[0::2] == [systems[0]] * 3 and systems[1::2] == [systems[1]] * 3
    assert systems[0] != systems[1]
    assert counter.count(systems[0].content) == 200
    for r in w.requests:
        assert r.input_tokens == 200 + counter.count(r.messages[1].content)


def test_multi_turn_resends_history(counter):
    w = make("multi-turn", counter, n=10, turns=4, input_len=20, output_len=10)
    assert [len(u) for u in w.units] == [4, 4, 2]
    for unit in w.units:
        for prev, cur in zip(unit, unit[1:], strict=False):
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert [m.role for m in cur.messages[len(prev.messages) :]] == ["assistant", "user"]
            assert counter.count(cur.messages[len(prev.messages)].content) == prev.output_tokens
            assert cur.session == prev.session and cur.turn == prev.turn + 1
            assert cur.input_tokens > prev.input_tokens


def test_chat_lengths_are_sharegpt_like():
    rng = random.Random(0)
    xs = [lognormal_length(rng, 161, 1.0, (4, 4096)) for _ in range(20000)]
    assert statistics.mean(xs) == pytest.approx(161, rel=0.05)
    assert statistics.median(xs) == pytest.approx(161 * 0.61, rel=0.05)  # exp(-sigma^2 / 2)
    w = make("chat", ApproxCounter(), n=50)
    assert all(4 <= r.output_tokens <= 2048 for r in w.requests)


def test_arrivals_reproducible_poisson():
    a = arrival_times(5000, 4.0, seed=3)
    assert a == arrival_times(5000, 4.0, seed=3) and a[0] == 0.0
    assert a != arrival_times(5000, 4.0, seed=4)
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    # The same draws at every rate: doubling the rate halves every offset.
    assert arrival_times(10, 8.0, seed=3) == pytest.approx([t / 2 for t in a[:10]])
    assert arrival_times(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_workload_specs_override_lengths():
    base = WorkloadConfig("random", 10, seed=2, input_len=100)
    cfg = parse_workload("prefill-heavy:input=512,output=8,output_spread=0", base)
    assert (cfg.kind, cfg.num_requests, cfg.seed) == ("prefill-heavy", 10, 2)
    assert (cfg.input_len, cfg.output_len, cfg.output_spread) == (512, 8, 0.0)
    assert parse_workload("decode-heavy", base).resolved().input_len == 100  # the flag's value
    assert WorkloadConfig("decode-heavy", 1).resolved().output_len == 512  # the kind's default
    for bad in ("nope", "chat:input", "chat:size=3", "chat:input=x"):
        with pytest.raises(ValueError):
            parse_workload(bad, base)
