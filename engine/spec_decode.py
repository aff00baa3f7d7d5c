"""Verification of speculative tokens: one forward pass scores a sequence's newest token and its
draft together, and the draft tokens the model agrees with are kept.

For a sequence with draft ``d_1..d_k`` the pass yields ``k + 1`` rows of logits: row ``j`` is
the model's next-token distribution ``p_j`` after the newest token and ``d_1..d_j``. Rows are
checked left to right:

- greedy: ``d_{j+1}`` is kept while it is the argmax of row ``j``; the first row that
  disagrees gives its argmax instead. The output is the non-speculative greedy output.
- sampling (rejection sampling, Leviathan et al. 2023 and Chen et al. 2023, for a draft that
  is a point mass, as an n-gram draft is): ``d_{j+1}`` is kept with probability
  ``p_j(d_{j+1})``; at the first rejection the token is drawn from ``p_j`` without
  ``d_{j+1}`` (renormalised). A kept draft is emitted with probability ``p_j(d)`` and any other
  token ``x`` with ``(1 - p_j(d)) * p_j(x) / (1 - p_j(d)) = p_j(x)``: each emitted token has the
  distribution plain sampling would give it. When every draft is kept, one more token is drawn
  from ``p_k``.

``p_j`` is what the sampler would use at that position: penalties over the outputs *including
the drafts before it*, then temperature, top-k, top-p and min-p. Logprobs are those of the raw
model rows, as for any token. A seeded sequence draws its acceptance tests and tokens from its
own generator, so its output depends only on its seed and its drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sample_output import PendingSample, SamplerOutput, host_output
from engine.sampler import (
    Sampler,
    SamplingRow,
    _apply_logit_bias_,
    apply_penalties_,
    filtered_probs,
    mask_stops_,
    race,
)
from engine.sampling_params import TokenLogprob


@dataclass(slots=True)
class VerifyOutput:
    """Per sequence: the tokens it emits this step (its kept draft tokens, then one more), their
    logprobs (None entries when not asked for) and how many draft tokens were kept."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]
    num_accepted: list[int]

    @classmethod
    def single(cls, out: SamplerOutput) -> VerifyOutput:
        """One token per sequence (no drafts)."""
        return cls(
            [[t] for t in out.token_ids], [[lp] for lp in out.logprobs], [0] * len(out.token_ids)
        )


class StepSample:
    """What a step sampled, as the model runner returns it: ``tokens``, the sampled ids on the
    device, one per sampling row (the next step's in-flight inputs are gathered from them; None
    for a step that verified drafts, which is read back at once), and ``result()``, the host
    lists (waits for the step's one copy to the host)."""

    def __init__(self, pending: PendingSample | None = None, done: VerifyOutput | None = None):
        assert (pending is None) != (done is None)
        self._pending = pending
        self._done = done

    @property
    def tokens(self) -> torch.Tensor | None:
        return self._pending.tokens if self._pending is not None else None

    def wait(self) -> None:
        """Block until the device has run the step; read nothing back."""
        if self._pending is not None:
            self._pending.wait()

    def result(self) -> VerifyOutput:
        if self._done is None:
            assert self._pending is not None
            self._done = VerifyOutput.single(self._pending.result())
        return self._done


def sample_with_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    due: Sequence[tuple[int, object]],
    rows: Sequence[SamplingRow],
    bitmask: torch.Tensor | None,
) -> VerifyOutput:
    """One step's sampling when some sequences verify drafts, in ``due`` order.

    ``logits`` holds ``1 + len(drafts[i])`` rows per sampling sequence ``i``; ``due`` names, per
    sampled row, its sequence ``i`` (forks repeat their parent's ``i``) and ``rows`` its state.
    Drafting sequences (never forks, never grammar-guided: the engine drafts for neither) go
    through ``verify``; every other row through the sampler, with its grammar mask, as in a step
    without drafts."""
    first, at = [], 0
    for d in drafts:
        first.append(at)
        at += 1 + len(d)
    out = VerifyOutput([[] for _ in due], [[] for _ in due], [0] * len(due))
    dev = logits.device
    plain = [j for j, (i, _) in enumerate(due) if not drafts[i]]
    if plain:
        idx = torch.tensor([first[due[j][0]] for j in plain], device=dev)
        mask = None if bitmask is None else bitmask[torch.tensor(plain, device=bitmask.device)]
        one = sampler(logits[idx], [rows[j] for j in plain], mask)
        for j, t, lp in zip(plain, one.token_ids, one.logprobs, strict=True):
            out.token_ids[j], out.logprobs[j] = [t], [lp]
    spec = [j for j, (i, _) in enumerate(due) if drafts[i]]
    if spec:
        owners = [due[j][0] for j in spec]
        idx = torch.tensor(
            [r for i in owners for r in range(first[i], first[i] + 1 + len(drafts[i]))], device=dev
        )
        res = verify(logits[idx], [rows[j] for j in spec], [drafts[i] for i in owners])
        for k, j in enumerate(spec):
            out.token_ids[j], out.logprobs[j] = res.token_ids[k], res.logprobs[k]
            out.num_accepted[j] = res.num_accepted[k]
    return out


def expand_rows(rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]) -> list[SamplingRow]:
    """One sampling row per logits row: row ``j`` of sequence ``i`` sees ``drafts[i][:j]`` as
    outputs already (its penalties count them)."""
    out = []
    for r, d in zip(rows, drafts, strict=True):
        outputs = list(r.output_token_ids)
        for j in range(len(d) + 1):
            seen = outputs + list(d[:j]) if j else r.output_token_ids
            row = SamplingRow(r.params, r.generator, r.prompt_token_ids, seen, r.guided, r.stop_ids)
            out.append(row)
    return out


def verify(
    logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]
) -> VerifyOutput:
    """Accept or reject each sequence's draft and pick its next token.

    ``logits`` holds ``len(drafts[i]) + 1`` consecutive rows per sequence ``i``, in order;
    ``rows[i]`` is that sequence's sampling state before this step.
    """
    total = sum(len(d) + 1 for d in drafts)
    if logits.dim() != 2 or logits.shape[0] != total:
        raise ValueError(f"logits must be [{total}, V], got {list(logits.shape)}")
    flat = expand_rows(rows, drafts)
    draft_of_row = [t for d in drafts for t in (*d, -1)]  # -1: the row after the whole draft
    if all(_plain(r) for r in flat):
        top = logits.argmax(dim=-1).tolist()
        return _settle(top, [c == d for c, d in zip(top, draft_of_row, strict=True)], drafts)
    cand, ok, raw_lp, want = _candidates(logits, flat, draft_of_row)
    cand_host, ok_host = torch.stack([cand, ok.long()]).tolist()  # one device-to-host copy
    out = _settle(cand_host, [bool(v) for v in ok_host], drafts)
    if raw_lp is not None:
        _fill_logprobs(out, raw_lp, want, flat, drafts)
    return out


def _plain(r: SamplingRow) -> bool:
    p = r.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.has_penalties
        and not p.logit_bias
        and not r.holds_stops
    )


def _candidates(
    logits: torch.Tensor, flat: list[SamplingRow], draft_of_row: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """Per row: the token emitted if the draft stops there, and whether the row keeps its draft
    token (greedy: it is the argmax; sampling: the acceptance test). Also the raw logprobs of
    the rows that want them."""
    dev = logits.device
    params = [r.params for r in flat]
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    held = [i for i, r in enumerate(flat) if r.holds_stops]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    x = logits.to(torch.float32, copy=bool(penalised or biased or held))
    raw_lp = torch.log_softmax(x[_index(want, dev)], dim=-1) if want else None
    if held:  # the sampler's order: stop tokens short of min_tokens, logit bias, penalties
        mask_stops_(x, flat, held)
    if biased:
        _apply_logit_bias_(x, params, biased)
    if penalised:
        apply_penalties_(x, flat, penalised)
    draft = torch.tensor(draft_of_row, dtype=torch.long, device=dev)
    cand = torch.empty(len(flat), dtype=torch.long, device=dev)
    ok = torch.zeros(len(flat), dtype=torch.bool, device=dev)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        g = _index(greedy, dev)
        top = x[g].argmax(dim=-1)
        cand[g], ok[g] = top, top == draft[g]
    if sampled:
        s = _index(sampled, dev)
        probs = filtered_probs(x[s], [params[i] for i in sampled])
        gens = [flat[i].generator for i in sampled]
        d = draft[s]
        has = d >= 0
        rows = torch.arange(len(sampled), device=dev)
        p_draft = torch.where(
            has, probs[rows, d.clamp(min=0)], torch.zeros_like(d, dtype=probs.dtype)
        )
        ok[s] = has & (_uniform(len(sampled), gens, dev) < p_draft)
        # Rejected: draw from p without the draft token (race ignores scale, so no renorm).
        probs[rows[has], d[has]] = 0.0
        cand[s] = race(probs, gens)
    return cand, ok, raw_lp, want


def _uniform(n: int, gens: list[torch.Generator | None], dev: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row; seeded rows draw from their own generator."""
    u = torch.rand(n, device=dev)
    for i, g in enumerate(gens):
        if g is not None:
            u[i] = torch.rand(1, generator=g, device=dev)[0]
    return u


def _index(idx: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor(idx, dtype=torch.long, device=dev)


def _settle(cand: list[int], ok: list[bool], drafts: Sequence[Sequence[int]]) -> VerifyOutput:
    """Walk each sequence's rows: keep draft tokens while their row accepts, then emit the
    candidate of the first row that does not (or of the row after the whole draft)."""
    tokens: list[list[int]] = []
    accepted: list[int] = []
    row = 0
    for d in drafts:
        n = 0
        while n < len(d) and ok[row + n]:
            n += 1
        tokens.append([*d[:n], cand[row + n]])
        accepted.append(n)
        row += len(d) + 1
    return VerifyOutput(tokens, [[None] * len(t) for t in tokens], accepted)


def _fill_logprobs(
    out: VerifyOutput,
    raw_lp: torch.Tensor,
    want: list[int],
    flat: list[SamplingRow],
    drafts: Sequence[Sequence[int]],
) -> None:
    """Logprobs of every emitted token of the sequences that asked for them."""
    where = {r: k for k, r in enumerate(want)}
    rows: list[int] = []
    tokens: list[int] = []
    slots: list[tuple[int, int]] = []
    start = 0
    for i, d in enumerate(drafts):
        if start in where:
            for j, t in enumerate(out.token_ids[i]):
                rows.append(where[start + j])
                tokens.append(t)
                slots.append((i, j))
        start += len(d) + 1
    if not rows:
        return
    dev = raw_lp.device
    lp = raw_lp[_index(rows, dev)]
    params = [flat[want[r]].params for r in rows]
    host = host_output(_index(tokens, dev), lp, list(range(len(rows))), params)
    for (i, j), v in zip(slots, host.logprobs, strict=True):
        out.logprobs[i][j] = v
