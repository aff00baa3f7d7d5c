"""Tests of engine.sampler: exact greedy/penalty/logprob behaviour, sampled distributions, seeds."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from engine.sampler import Sampler, SamplerOutput, SamplingRow, apply_penalties_
from engine.sampling_params import SamplingParams

# probs 0.5, 0.3, 0.15, 0.05: every top-p / min-p cut below sits well away from a boundary.
PROBS_4 = [0.5, 0.3, 0.15, 0.05]


def make_row(
    seed: int | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    device: str = "cpu",
    **params: Any,
) -> SamplingRow:
    """A row as the engine builds it: a fresh generator seeded with ``seed`` when one is given."""
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return SamplingRow(
        SamplingParams(seed=seed, **params),
        generator,
        list(prompt),
        list(output),
    )


def log_probs(probs: Sequence[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs]).repeat(rows, 1)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    return Sampler()(logits, rows)


def draw_counts(probs: Sequence[float], n: int, **params: Any) -> Counter[int]:
    """Token counts of ``n`` unseeded draws from ``probs`` (one batched call, fixed global seed)."""
    torch.manual_seed(0)
    rows = [make_row(**params) for _ in range(n)]
    return Counter(sample(log_probs(probs, n), rows).token_ids)


def chi_square(counts: Counter[int], expected: Sequence[float], n: int) -> float:
    return sum((counts[t] - n * p) ** 2 / (n * p) for t, p in enumerate(expected) if p > 0)


# --- greedy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = sample(logits, [make_row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_tie_takes_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    assert sample(logits, [make_row(temperature=0.0)]).token_ids == [1]


def test_greedy_seeded_row_ignores_generator() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    row = make_row(seed=7, temperature=0.0)
    state = row.generator.get_state()  # type: ignore[union-attr]
    assert sample(logits, [row]).token_ids == [1]
    assert torch.equal(row.generator.get_state(), state)  # type: ignore[union-attr]


def test_empty_batch_and_bad_shape() -> None:
    assert sample(torch.empty(0, 10), []) == SamplerOutput([], [])
    with pytest.raises(ValueError, match=r"\[2, V\]"):
        sample(torch.zeros(3, 10), [make_row(), make_row()])
    with pytest.raises(ValueError):
        sample(torch.zeros(10), [make_row()])


# --- temperature, top-k, top-p, min-p ----------------------------------------------------------


def test_temperature_distribution_matches_softmax() -> None:
    logits = [1.0, 0.5, 0.0, -0.5, -1.0]
    n = 20_000
    expected = torch.softmax(torch.tensor(logits) / 0.7, dim=-1).tolist()
    torch.manual_seed(0)
    out = sample(torch.tensor(logits).repeat(n, 1), [make_row(temperature=0.7)] * n)
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001.
    assert chi_square(Counter(out.token_ids), expected, n) < 18.47


def test_seeded_distribution_matches_softmax() -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0]])
    n = 3000
    expected = torch.softmax(logits[0], dim=-1).tolist()
    row = make_row(seed=3)
    counts = Counter(sample(logits, [row]).token_ids[0] for _ in range(n))
    assert chi_square(counts, expected, n) < 18.47


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(2))
    rows = [make_row(seed=i if i % 2 else None, temperature=1.5, top_k=1) for i in range(16)]
    assert sample(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_exactly_k_tokens() -> None:
    counts = draw_counts(PROBS_4, 4000, top_k=2)
    assert set(counts) == {0, 1}
    assert counts[0] / 4000 == pytest.approx(0.5 / 0.8, abs=0.03)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.3, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_minimal_nucleus(top_p: float, kept: set[int]) -> None:
    counts = draw_counts(PROBS_4, 4000, top_p=top_p)
    assert set(counts) == kept
    total = sum(PROBS_4[t] for t in kept)
    assert counts[0] / 4000 == pytest.approx(0.5 / total, abs=0.03)


def test_top_k_then_top_p() -> None:
    # top-k=3 renormalises to 0.526, 0.316, 0.158: 0.842 lies before token 2, so top-p=0.82 drops
    # it; on the unfiltered probs only 0.8 lies before token 2, so top-p alone keeps it.
    assert set(draw_counts(PROBS_4, 2000, top_k=3, top_p=0.82)) == {0, 1}
    assert set(draw_counts(PROBS_4, 2000, top_p=0.82)) == {0, 1, 2}


@pytest.mark.parametrize(
    ("min_p", "kept"), [(0.05, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})]
)
def test_min_p_drops_tokens_below_fraction_of_max(min_p: float, kept: set[int]) -> None:
    assert set(draw_counts(PROBS_4, 2000, min_p=min_p)) == kept


def test_temperature_applies_before_filtering() -> None:
    # Relative to the top token, probs are 1, 0.6, 0.3, 0.1; at temperature 2 they are their
    # square roots 1, 0.77, 0.55, 0.32, so min_p=0.4 keeps two tokens at T=1 and three at T=2.
    assert set(draw_counts(PROBS_4, 2000, min_p=0.4)) == {0, 1}
    assert set(draw_counts(PROBS_4, 2000, temperature=2.0, min_p=0.4)) == {0, 1, 2}


# --- penalties ---------------------------------------------------------------------------------


def penalised(logits: Sequence[float], **row: Any) -> list[float]:
    x = torch.tensor([logits])
    apply_penalties_(x, [make_row(**row)], [0])
    return x[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    got = penalised(
        [2.0, -1.0, 3.0, -2.0, 1.0], prompt=[0, 1, 0], output=[3, 3], repetition_penalty=2.0
    )
    assert got == [1.0, -2.0, 3.0, -4.0, 1.0]


def test_repetition_penalty_flips_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.8, -1.0]])
    assert sample(logits, [make_row(temperature=0.0, prompt=[0])]).token_ids == [0]
    row = make_row(temperature=0.0, prompt=[0], repetition_penalty=1.2)  # 2.0 -> 1.667
    assert sample(logits, [row]).token_ids == [1]
    negative = torch.tensor([[-1.0, -1.1, -5.0]])  # -1.0 -> -1.2: multiplied, not divided
    row = make_row(temperature=0.0, output=[0], repetition_penalty=1.2)
    assert sample(negative, [row]).token_ids == [1]


def test_frequency_penalty_scales_with_output_count_only() -> None:
    got = penalised([1.0, 1.0, 1.0, 1.0], prompt=[2, 2], output=[0, 1, 0, 0], frequency_penalty=0.5)
    assert got == [-0.5, 0.5, 1.0, 1.0]
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    flip = make_row(temperature=0.0, output=[0, 0, 0], frequency_penalty=0.2)  # 2.0 -> 1.4
    stay = make_row(temperature=0.0, output=[0, 0], frequency_penalty=0.2)  # 2.0 -> 1.6
    prompt_only = make_row(temperature=0.0, prompt=[0] * 5, frequency_penalty=2.0)
    assert sample(logits.repeat(3, 1), [flip, stay, prompt_only]).token_ids == [1, 0, 0]


def test_presence_penalty_counts_each_output_token_once() -> None:
    got = penalised([1.0, 1.0, 1.0], prompt=[2], output=[0, 1, 0, 0], presence_penalty=0.5)
    assert got == [0.5, 0.5, 1.0]
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    flip = make_row(temperature=0.0, output=[0], presence_penalty=0.6)  # 2.0 -> 1.4
    once = make_row(temperature=0.0, output=[0] * 5, presence_penalty=0.4)  # 2.0 -> 1.6
    boost = make_row(temperature=0.0, output=[2], presence_penalty=-1.0)  # 0.0 -> 1.0
    assert sample(logits.repeat(3, 1), [flip, once, boost]).token_ids == [1, 0, 0]
    assert penalised([0.0, 0.0, 0.0], output=[2], presence_penalty=-1.0) == [0.0, 0.0, 1.0]


def test_penalties_compose_repetition_then_frequency_and_presence() -> None:
    got = penalised(
        [4.0, 4.0, 4.0],
        prompt=[1],
        output=[0, 0],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    assert got == [4.0 / 2 - 2 * 0.5 - 0.25, 2.0, 4.0]


def test_penalties_touch_only_rows_that_set_them_and_not_the_input() -> None:
    logits = torch.tensor([[2.0, 1.5], [2.0, 1.5]])
    before = logits.clone()
    rows = [
        make_row(temperature=0.0, output=[0], presence_penalty=1.0),
        make_row(temperature=0.0, output=[0]),
    ]
    assert sample(logits, rows).token_ids == [1, 0]
    assert torch.equal(logits, before)


# --- seeds -------------------------------------------------------------------------------------


def seeded_stream(seed: int, steps: int, batch_with: int) -> list[int]:
    """Tokens of one seeded row over ``steps`` steps, batched with ``batch_with`` other rows.

    The other rows (greedy, unseeded, other seeds, top-p and penalties, so that every code path
    runs beside the seeded row) change each step, and so does the seeded row's position.
    """
    data = torch.Generator().manual_seed(99)
    torch.manual_seed(batch_with)
    row = make_row(seed=seed, temperature=0.9, top_k=50, min_p=0.01)
    kinds: list[dict[str, Any]] = [
        dict(temperature=0.0),
        dict(top_p=0.9),
        dict(seed=5, top_p=0.5, frequency_penalty=0.5),
        dict(temperature=1.3, repetition_penalty=1.3, logprobs=3),
    ]
    tokens: list[int] = []
    for step in range(steps):
        logits = torch.randn(1, 200, generator=data) * 2
        if not batch_with:
            tokens += sample(logits, [row]).token_ids
            continue
        others = [make_row(output=[1, 2, 2], **kinds[(step + j) % 4]) for j in range(batch_with)]
        at = step % (batch_with + 1)
        rows = others[:at] + [row] + others[at:]
        batch = torch.randn(batch_with + 1, 200) * 2
        batch[at] = logits[0]
        tokens.append(sample(batch, rows).token_ids[at])
    return tokens


def test_same_seed_gives_same_stream_whatever_the_batch() -> None:
    alone = seeded_stream(seed=1234, steps=50, batch_with=0)
    assert len(set(alone)) > 10  # really sampled, not stuck on one token
    assert seeded_stream(seed=1234, steps=50, batch_with=3) == alone
    assert seeded_stream(seed=1234, steps=50, batch_with=6) == alone


def test_different_seeds_give_different_streams() -> None:
    a = seeded_stream(seed=1, steps=50, batch_with=0)
    b = seeded_stream(seed=2, steps=50, batch_with=0)
    assert sum(x != y for x, y in zip(a, b, strict=True)) > 25


# --- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_of_raw_logits_with_sorted_top_k() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    rows = [
        make_row(seed=1, logprobs=5, temperature=0.5, top_p=0.8, output=[3], presence_penalty=2.0),
        make_row(logprobs=0, temperature=0.0, prompt=[7], repetition_penalty=3.0),
        make_row(temperature=0.0),
        make_row(logprobs=20, top_k=10),
    ]
    out = sample(logits, rows)
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs[2] is None
    for i, k in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(expected[i, lp.token_id].item(), rel=1e-6)
        assert len(lp.top) == k
        values, ids = expected[i].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), rel=1e-6)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


# --- mixed batches -----------------------------------------------------------------------------


def test_mixed_batch_matches_rows_sampled_alone() -> None:
    logits = torch.randn(5, 400, generator=torch.Generator().manual_seed(6))
    rows = [
        make_row(temperature=0.0),
        make_row(seed=11, temperature=0.8),
        make_row(top_k=3),
        make_row(seed=12, top_p=0.9, logprobs=2),
        make_row(temperature=0.0, output=[int(logits[4].argmax())], presence_penalty=2.0),
    ]
    out = sample(logits, rows)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[2] in logits[2].topk(3).indices.tolist()
    assert out.token_ids[4] == logits[4].topk(2).indices[1].item()
    alone_params: list[tuple[int, int, dict[str, Any]]] = [
        (1, 11, dict(temperature=0.8)),
        (3, 12, dict(top_p=0.9)),
    ]
    for i, seed, params in alone_params:
        alone = sample(logits[i : i + 1], [make_row(seed=seed, **params)])
        assert out.token_ids[i] == alone.token_ids[0]
    assert [lp is not None for lp in out.logprobs] == [False, False, False, True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mixed_batch() -> None:
    logits = torch.randn(6, 32_000, device="cuda", dtype=torch.bfloat16)
    rows = [
        make_row(temperature=0.0),
        make_row(seed=3, device="cuda", top_p=0.9, top_k=40, min_p=0.05),
        make_row(logprobs=4, output=[1, 2, 2], frequency_penalty=0.5),
        make_row(temperature=0.0, prompt=[5], repetition_penalty=1.5),
        make_row(top_k=1),
        make_row(seed=3, device="cuda", top_p=0.9, top_k=40, min_p=0.05),
    ]
    logits[5] = logits[1]
    out = sample(logits, rows)
    argmax = logits.float().argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0]
    assert out.token_ids[4] == argmax[4]
    assert out.token_ids[1] == out.token_ids[5]  # same seed, same logits, same step
    lp = out.logprobs[2]
    assert lp is not None and len(lp.top) == 4
    expected = torch.log_softmax(logits[2].float(), dim=-1)
    assert lp.logprob == pytest.approx(expected[lp.token_id].item(), rel=1e-5)


# --- grammar bitmask and logit bias ------------------------------------------------------------


def bitmask(allowed_per_row: Sequence[set[int]], vocab: int) -> torch.Tensor:
    """An int32 bitmask (bit t % 32 of word t // 32) allowing exactly the given tokens."""
    words = (vocab + 31) // 32
    mask = torch.zeros(len(allowed_per_row), words, dtype=torch.int64)
    for i, allowed in enumerate(allowed_per_row):
        for t in allowed:
            mask[i, t // 32] |= 1 << (t % 32)
    return mask.to(torch.int32)  # wraps bit 31 to the sign bit, as llguidance stores it


def test_bitmask_restricts_guided_rows_only() -> None:
    vocab = 70  # three words, the last one partial
    logits = torch.randn(3, vocab)
    guided = SamplingRow(SamplingParams(temperature=0), None, [], [], guided=True)
    hot = SamplingRow(SamplingParams(temperature=5.0), None, [], [], guided=True)
    free = SamplingRow(SamplingParams(temperature=0), None, [], [])
    mask = bitmask([{31, 64}, {5, 33, 69}, set()], vocab)
    out = Sampler()(logits, [guided, hot, free], mask)
    assert out.token_ids[0] == max((31, 64), key=lambda t: logits[0, t].item())
    assert out.token_ids[2] == logits[2].argmax().item()  # not guided: its (empty) row is unused
    torch.manual_seed(0)
    drawn = {Sampler()(logits, [guided, hot, free], mask).token_ids[1] for _ in range(200)}
    assert drawn <= {5, 33, 69} and len(drawn) > 1


def test_bitmask_keeps_raw_logprobs() -> None:
    logits = log_probs(PROBS_4)
    row = SamplingRow(SamplingParams(temperature=0, logprobs=2), None, [], [], guided=True)
    out = Sampler()(logits, [row], bitmask([{2}], 4))
    lp = out.logprobs[0]
    assert out.token_ids == [2] and lp is not None
    assert lp.logprob == pytest.approx(math.log(0.15), abs=1e-5)
    assert [t for t, _ in lp.top] == [0, 1]


def test_logit_bias_moves_greedy_choice_and_sampling() -> None:
    logits = log_probs(PROBS_4, 2)
    up = make_row(temperature=0, logit_bias=((3, 100.0),))
    down = make_row(temperature=0, logit_bias={0: -100.0, 1: -100.0})
    assert sample(logits, [up, down]).token_ids == [3, 2]
    counts = draw_counts(PROBS_4, 2000, logit_bias=((0, -100.0),))
    assert counts[0] == 0 and chi_square(counts, [0, 0.6, 0.3, 0.1], 2000) < 13.8  # df 2, p = 0.001
    assert logits.equal(log_probs(PROBS_4, 2))  # the input is never modified


def test_min_tokens_masks_the_stop_tokens_until_reached() -> None:
    """vLLM's min_tokens: a row's stop tokens (EOS and stop_token_ids, given by the engine as
    ``stop_ids``) cannot be drawn while it has fewer outputs; the raw logprobs stay unmasked."""
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]] * 3)  # 1 (EOS) is the argmax, then 2
    p = SamplingParams(temperature=0, min_tokens=2, max_tokens=5, logprobs=1)
    rows = [SamplingRow(p, None, [0], out, stop_ids=(1, 2)) for out in ([], [3], [3, 3])]
    out = sample(logits, rows)
    assert out.token_ids == [3, 3, 1]  # 1 and 2 masked while short of 2 outputs
    assert out.logprobs[0].top[0][0] == 1  # the raw distribution's best is still reported
    hot = SamplingRow(SamplingParams(temperature=1.0, min_tokens=1), None, [0], [], stop_ids=(1,))
    assert all(sample(logits[:1], [hot]).token_ids[0] != 1 for _ in range(50))
