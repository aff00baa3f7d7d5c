"""Speculative decoding pieces without a model: the n-gram proposer, the config, and the
verifier (greedy acceptance, and a statistical test that rejection sampling preserves the
distribution the sampler would use)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.ngram import NgramProposer, lookup
from engine.sampler import SamplingRow, filtered_probs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec_decode import verify


def arr(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


# -- proposer ----------------------------------------------------------------------------------
def test_lookup_takes_the_longest_suffix_then_the_latest_occurrence() -> None:
    #           0  1  2  3  4  5  6  7  8  9 10 11
    t = arr(5, 1, 2, 9, 8, 3, 1, 2, 7, 4, 1, 2)
    # "1 2" occurred at 1 (then 9) and at 6 (then 7): the latest wins.
    assert lookup(t, 1, 2, 3) == [7, 4, 1]
    # With a 3-gram allowed, "4 1 2" never occurred before; falls back to the 2-gram.
    assert lookup(t, 2, 3, 2) == [7, 4]
    # Only 3-grams: no match at all.
    assert lookup(t, 3, 3, 2) == []
    # A longer match beats a more recent shorter one: "3 1 2" at 5..7, not "1 2" at 10.
    t2 = arr(3, 1, 2, 6, 6, 9, 1, 2, 5, 3, 1, 2)
    assert lookup(t2, 1, 3, 2) == [6, 6]


def test_lookup_draft_may_run_into_the_suffix_and_stops_at_the_end() -> None:
    t = arr(7, 7, 7, 7)  # periodic: the latest earlier "7 7" is at 1..2, followed by one token
    assert lookup(t, 2, 2, 5) == [7]
    assert lookup(arr(4), 1, 3, 2) == []
    assert lookup(arr(4, 4), 1, 3, 2) == [4]


def test_proposer_follows_the_growing_history_and_limits() -> None:
    seq = Sequence("s", [10, 11, 12, 13, 10, 11], SamplingParams(), 0)
    prop = NgramProposer(num_tokens=3, min_n=1, max_n=2)
    assert prop.propose(seq, limit=10) == [12, 13, 10]
    assert prop.propose(seq, limit=2) == [12, 13]
    assert prop.propose(seq, limit=0) == []
    seq.output_token_ids += [12, 99]  # "99" never seen: no draft
    assert prop.propose(seq, limit=10) == []
    seq.output_token_ids += list(range(300, 600)) + [12]  # past the initial buffer
    assert prop.propose(seq, limit=10) == [99, 300, 301]


# -- config ------------------------------------------------------------------------------------
def test_speculative_config_follows_vllm_defaults_and_refuses_bad_values() -> None:
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert c is not None and (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse(
        '{"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4}'
    )
    assert c is not None and c.method == "ngram" and c.prompt_lookup_min == 4
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert c is not None and c.prompt_lookup_max == 2
    assert SpeculativeConfig.parse("") is None and SpeculativeConfig.parse(None) is None
    bad = [
        {"method": "eagle", "num_speculative_tokens": 2},
        {"method": "ngram"},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
        {"num_speculative_tokens": 2, "model": "x"},
        "[1, 2]",
        "{not json",
    ]
    for value in bad:
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(value)  # type: ignore[arg-type]
    cfg = EngineConfig(model_dir="m", speculative_config={"num_speculative_tokens": 4})
    assert isinstance(cfg.speculative_config, SpeculativeConfig)


# -- verifier: greedy --------------------------------------------------------------------------
def row(params: SamplingParams, outputs=(), generator=None) -> SamplingRow:
    return SamplingRow(params, generator, [1, 2, 3], list(outputs))


def peaked(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_keeps_the_agreeing_prefix_and_corrects_the_first_miss() -> None:
    greedy = SamplingParams(temperature=0)
    # seq 0: draft [4, 5, 6], model says 4, 5, 9, (7): keeps 4, 5 then emits 9.
    # seq 1: no draft: emits its argmax 3.  seq 2: draft [8] fully kept, bonus 2.
    logits = peaked([4, 5, 9, 7, 3, 8, 2])
    out = verify(logits, [row(greedy)] * 3, [[4, 5, 6], [], [8]])
    assert out.token_ids == [[4, 5, 9], [3], [8, 2]]
    assert out.num_accepted == [2, 0, 1]
    # The same through the non-plain path (logprobs asked for): logprobs of each emitted row.
    lp = SamplingParams(temperature=0, logprobs=1)
    out = verify(logits, [row(lp)] * 3, [[4, 5, 6], [], [8]])
    assert out.token_ids == [[4, 5, 9], [3], [8, 2]]
    ref = torch.log_softmax(logits, dim=-1)
    emitted_rows = [(0, 4), (1, 5), (2, 9), (4, 3), (5, 8), (6, 2)]
    flat = [x for lps in out.logprobs for x in lps]
    assert [x.token_id for x in flat if x is not None] == [t for _, t in emitted_rows]
    for x, (r, t) in zip(flat, emitted_rows, strict=True):
        assert x is not None and math.isclose(x.logprob, ref[r, t].item(), abs_tol=1e-5)
        assert x.top[0][0] == t


def test_greedy_penalties_count_the_drafts_before_each_position() -> None:
    # A repetition penalty turns token 4's logit (2.0) at row 1 into 2.0 / 10 once token 4 was
    # drafted at position 0: the model then prefers 6 there.
    logits = torch.zeros(2, 10)
    logits[0, 4] = 3.0
    logits[1, 4], logits[1, 6] = 2.0, 1.0
    p = SamplingParams(temperature=0, repetition_penalty=10.0)
    out = verify(logits, [row(p)], [[4]])
    assert out.token_ids == [[4, 6]]


def test_min_tokens_masks_stop_tokens_at_each_draft_position() -> None:
    """A row short of min_tokens may not draw its stop token (EOS 7 here); each draft position
    counts the drafts before it, so the mask lifts exactly at min_tokens."""
    logits = peaked([7, 7, 7])  # the model wants to stop at every position
    logits[:, 5] = 4.0  # second best
    p = SamplingParams(temperature=0, min_tokens=3, max_tokens=10)
    short = SamplingRow(p, None, [1, 2, 3], [9], stop_ids=(7,))  # one output so far
    out = verify(logits, [short], [[5, 5]])
    assert out.token_ids == [[5, 5, 7]]  # outputs 2 and 3 masked; the 4th may stop
    assert out.num_accepted == [2]


# -- verifier: rejection sampling --------------------------------------------------------------
def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = n * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02),
    ],
    ids=["plain", "top_k", "top_p_min_p"],
)
def test_rejection_sampling_preserves_the_distribution(params: SamplingParams) -> None:
    """Many copies of one sequence with a 2-token draft in one batch: the first emitted token
    must follow p_0; the second, among copies that kept draft token 1, must follow p_1; the
    third, among copies that kept both, must follow p_2 (the bonus row)."""
    torch.manual_seed(0)
    vocab, n = 12, 30000
    base = torch.randn(3, vocab) * 1.5
    probs = filtered_probs(base.clone(), [params] * 3).numpy().astype(np.float64)
    # Draft each row's second most likely token: kept often, but far from always.
    drafts = [int(np.argsort(probs[j])[-2]) for j in range(2)]
    logits = base.repeat(n, 1)
    out = verify(logits, [row(params)] * n, [drafts] * n)
    first = np.bincount([t[0] for t in out.token_ids], minlength=vocab)
    stat, df = chi2(first, probs[0])
    assert stat < chi2_critical(df), (stat, df)
    kept1 = [t for t in out.token_ids if len(t) >= 2]
    assert len(kept1) > 2000
    second = np.bincount([t[1] for t in kept1], minlength=vocab)
    stat, df = chi2(second, probs[1])
    assert stat < chi2_critical(df), (stat, df)
    kept2 = [t for t in out.token_ids if len(t) == 3]
    assert len(kept2) > 1000
    third = np.bincount([t[2] for t in kept2], minlength=vocab)
    stat, df = chi2(third, probs[2])
    assert stat < chi2_critical(df), (stat, df)
    # The acceptance rate of a draft token is its probability.
    acc0, p0 = np.mean([a >= 1 for a in out.num_accepted]), probs[0][drafts[0]]
    assert abs(acc0 - p0) < 4 * math.sqrt(p0 * (1 - p0) / n)


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=7)

    def run(extra: int) -> list[int]:
        g = torch.Generator().manual_seed(7)
        rows = [row(p, generator=g)] + [row(SamplingParams(temperature=1.0))] * extra
        lg = torch.cat([logits] + [logits] * extra)
        return verify(lg, rows, [[1, 2]] + [[1, 2]] * extra).token_ids[0]

    assert run(0) == run(0) == run(3)
