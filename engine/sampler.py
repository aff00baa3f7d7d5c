"""Batched token sampler: grammar masks, logit bias, penalties, greedy, temperature, top-k /
top-p / min-p, seeds, logprobs.

One call per decode step turns ``[B, V]`` logits into one token per row. The common case (every
row greedy, no penalties, no logprobs) is a single ``argmax``; everything else is vectorised over
the rows that need it, with per-row Python work only for penalties and seeded rows. Nothing in
it waits for the device: index and parameter vectors go up without a stream sync
(``engine.device_io``), and the tokens stay on the device with their host copy started
(``Sampler.sample``; ``engine.sample_output``), so with async scheduling the next step is
launched before this one's tokens are read.

Sampling uses the exponential race: ``argmax(probs / E)`` with ``E ~ Exponential(1)`` i.i.d. draws
token ``i`` with probability ``probs[i]``. A seeded row draws its ``E`` from its own generator, one
row at a time, so its token depends only on (seed, its logits, how many steps its generator has
taken) and never on the other rows of the batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.device_io import upload
from engine.sample_output import PendingSample, SamplerOutput, pending_output
from engine.sampling_params import SamplingParams
from engine.structured import apply_bitmask_

# Temperatures below this are raised to it: dividing logits by a far smaller one can overflow to
# inf (then softmax gives nan), and the distribution is already a point mass on the argmax.
MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingRow:
    """The sampling state of one request, i.e. of one row of the batch logits.

    ``generator`` is the request's own generator when ``params.seed`` is set (made by the engine
    on the logits' device with ``torch.Generator(device=...).manual_seed(seed)``), else ``None``.
    Token ids must be smaller than the vocabulary size ``V``. ``guided`` rows follow a grammar:
    the sampler's bitmask row of theirs says which tokens they may take. ``stop_ids`` (EOS and
    ``stop_token_ids``) are masked while the row has fewer than ``params.min_tokens`` outputs.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    guided: bool = False
    stop_ids: Sequence[int] = ()

    @property
    def holds_stops(self) -> bool:
        """Whether its stop tokens are masked now (fewer than ``min_tokens`` outputs)."""
        return bool(self.stop_ids) and len(self.output_token_ids) < self.params.min_tokens


class Sampler:
    """Picks the next token of every row of a batch. Stateless; safe to share."""

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """``sample``, waited for: the tokens (and logprobs) on the host."""
        return self.sample(logits, rows, bitmask).result()

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        bitmask: torch.Tensor | None = None,
    ) -> PendingSample:
        """Sample one token per row of ``logits`` (``[B, V]``, any float dtype, CPU or CUDA);
        the tokens stay on the device, their copy to the host is under way.

        Order: logprobs of the raw logits; the grammar mask of guided rows (``bitmask``, int32
        ``[B, ceil(V / 32)]`` on the logits' device, see ``engine.structured``); the stop tokens
        of rows short of ``min_tokens``; logit bias; penalties; then greedy argmax, or
        temperature, top-k, top-p, min-p and sampling. Work is done in float32; ``logits`` is
        never modified.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [len(rows), V] = [{len(rows)}, V], got {list(logits.shape)}"
            )
        params = [r.params for r in rows]
        if all(_is_plain(r) for r in rows):
            # Fast path. Converting to float32 is exact, so argmax on the input dtype is the same.
            return pending_output(logits.argmax(dim=-1), None, [], params)
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        guided = [i for i, r in enumerate(rows) if r.guided] if bitmask is not None else []
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        held = [i for i, r in enumerate(rows) if r.holds_stops]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        x = logits.to(torch.float32, copy=bool(penalised or guided or biased or held))
        raw_logprobs = torch.log_softmax(_take(x, want_lp), dim=-1) if want_lp else None
        if guided:
            assert bitmask is not None
            masked = _take(x, guided)
            apply_bitmask_(masked, _take(bitmask, guided))
            if masked is not x:
                _put(x, guided, masked)
        if held:
            mask_stops_(x, rows, held)
        if biased:
            _apply_logit_bias_(x, params, biased)
        if penalised:
            apply_penalties_(x, rows, penalised)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
        if greedy:
            _put(tokens, greedy, _take(x, greedy).argmax(dim=-1))
        if sampled:
            _put(tokens, sampled, _sample(_take(x, sampled), [rows[i] for i in sampled]))
        return pending_output(tokens, raw_logprobs, want_lp, params)


def _is_plain(r: SamplingRow) -> bool:
    p = r.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.has_penalties
        and not p.logit_bias
        and not (r.guided)
        and not r.holds_stops
    )


def mask_stops_(x: torch.Tensor, rows: Sequence[SamplingRow], idx: Sequence[int]) -> None:
    """``x[i, t] = -inf`` for each stop token ``t`` of ``rows[i]``, ``i`` in ``idx`` (rows short
    of ``min_tokens``: they may not end yet)."""
    # An id past the vocabulary (a stop_token_ids typo) cannot be drawn anyway.
    pairs = [(i, t) for i in idx for t in rows[i].stop_ids if t < x.shape[1]]
    if pairs:
        dev = x.device
        r, t = zip(*pairs, strict=True)
        x[upload(r, torch.long, dev), upload(t, torch.long, dev)] = float("-inf")


def _apply_logit_bias_(
    x: torch.Tensor, params: Sequence[SamplingParams], idx: Sequence[int]
) -> None:
    """``x[i, t] += bias`` for each ``(t, bias)`` of ``params[i].logit_bias``, ``i`` in ``idx``."""
    r = [i for i in idx for _ in params[i].logit_bias]
    t = [tok for i in idx for tok, _ in params[i].logit_bias]
    b = [bias for i in idx for _, bias in params[i].logit_bias]
    dev = x.device
    rows, toks = upload(r, torch.long, dev), upload(t, torch.long, dev)
    x.index_put_((rows, toks), upload(b, x.dtype, dev), accumulate=True)


def _index(idx: Sequence[int], device: torch.device) -> torch.Tensor:
    return upload(idx, torch.long, device)


def _take(x: torch.Tensor, idx: Sequence[int]) -> torch.Tensor:
    """Rows ``idx`` of ``x``; ``x`` itself (no copy) when ``idx`` is every row, in order."""
    if len(idx) == x.shape[0]:
        return x
    return x[_index(idx, x.device)]


def _put(x: torch.Tensor, idx: Sequence[int], values: torch.Tensor) -> None:
    """``x[idx] = values`` in place (``idx`` ascending, as built by the callers)."""
    if len(idx) == x.shape[0]:
        x.copy_(values)
    else:
        x[_index(idx, x.device)] = values


def apply_penalties_(x: torch.Tensor, rows: Sequence[SamplingRow], idx: Sequence[int]) -> None:
    """Apply the penalties of ``rows[i]`` to ``x[i]`` in place, for each ``i`` in ``idx``.

    Repetition penalty (HF): over prompt and output tokens, a positive logit is divided by the
    penalty and a negative one multiplied. Then frequency and presence penalties (OpenAI), over
    output tokens only: ``x[t] -= frequency * count(t) + presence * (count(t) > 0)``.
    """
    rep = [i for i in idx if rows[i].params.repetition_penalty != 1.0]
    if rep:
        _repetition_(x, rows, rep)
    freq = [
        i
        for i in idx
        if rows[i].params.frequency_penalty != 0.0 or rows[i].params.presence_penalty != 0.0
    ]
    if freq:
        _frequency_presence_(x, rows, freq)


def _repetition_(x: torch.Tensor, rows: Sequence[SamplingRow], idx: Sequence[int]) -> None:
    seqs = [s for i in idx for s in (rows[i].prompt_token_ids, rows[i].output_token_ids)]
    r, t = _pairs(seqs, [i for i in idx for _ in range(2)])
    if not r.size:
        return
    per_row = np.ones(x.shape[0], dtype=np.float32)
    per_row[idx] = [rows[i].params.repetition_penalty for i in idx]
    penalty = _to(per_row[r], x.device)
    r_t, t_t = _to(r, x.device), _to(t, x.device)
    # A token seen twice yields the same (row, token) pair twice; both writes carry the same value
    # (computed from the logit before any write), so duplicates are harmless.
    v = x[r_t, t_t]
    x[r_t, t_t] = torch.where(v > 0, v / penalty, v * penalty)


def _frequency_presence_(x: torch.Tensor, rows: Sequence[SamplingRow], idx: Sequence[int]) -> None:
    r, t = _pairs([rows[i].output_token_ids for i in idx], idx)
    if not r.size:
        return
    vocab = x.shape[1]
    keys, counts = np.unique(r * vocab + t, return_counts=True)
    r, t = np.divmod(keys, vocab)
    frequency = np.zeros(x.shape[0], dtype=np.float32)
    presence = np.zeros(x.shape[0], dtype=np.float32)
    frequency[idx] = [rows[i].params.frequency_penalty for i in idx]
    presence[idx] = [rows[i].params.presence_penalty for i in idx]
    delta = frequency[r] * counts.astype(np.float32) + presence[r]
    # (row, token) pairs are unique here, so this subtracts once per pair.
    x.index_put_((_to(r, x.device), _to(t, x.device)), -_to(delta, x.device), accumulate=True)


def _pairs(seqs: Sequence[Sequence[int]], owners: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Flatten token sequences into (row, token) arrays; ``owners[j]`` is the row of ``seqs[j]``.

    numpy's ``fromiter`` turns Python ints into an array several times faster than
    ``torch.tensor(list)``, which matters with long prompts.
    """
    lengths = [len(s) for s in seqs]
    total = sum(lengths)
    tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total)
    return np.repeat(np.asarray(owners, dtype=np.int64), lengths), tokens


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    # Pageable and non-blocking: staged at once, without waiting for the device's queue.
    return torch.from_numpy(a).to(device, non_blocking=True)


def _sample(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Sample one token per row of the penalised logits ``x`` (``[S, V]``, non-greedy rows)."""
    return race(filtered_probs(x, [r.params for r in rows]), [r.generator for r in rows])


def filtered_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each non-greedy row samples from: softmax of the penalised logits
    ``x`` (``[S, V]``) after temperature, top-k, top-p and min-p (a new tensor)."""
    temperature = upload([max(p.temperature, MIN_TEMPERATURE) for p in params], x.dtype, x.device)
    x = x / temperature.unsqueeze(1)  # a new tensor: filtering below may write into it
    # Which filter path a row takes depends on its own params only, so a seeded row's
    # probabilities do not depend on which other rows share the batch.
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    top_k_only = [i for i, p in enumerate(params) if p.top_k > 0 and p.top_p == 1.0]
    if top_k_only:
        k = [params[i].top_k for i in top_k_only]
        _put(x, top_k_only, _top_k(_take(x, top_k_only), k))
    if nucleus:
        k = [params[i].top_k for i in nucleus]
        p = [params[i].top_p for i in nucleus]
        _put(x, nucleus, _top_k_top_p(_take(x, nucleus), k, p))
    min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        _put(x, min_p, _min_p(_take(x, min_p), [params[i].min_p for i in min_p]))
    return torch.softmax(x, dim=-1)


def _top_k(x: torch.Tensor, k: Sequence[int]) -> torch.Tensor:
    """Keep the ``k[i]`` largest logits of row ``i`` (every ``k[i] > 0``); the rest become -inf."""
    k_max = min(max(k), x.shape[1])
    values, ids = x.topk(k_max, dim=-1)
    rank = torch.arange(k_max, device=x.device)
    k_t = upload(k, torch.long, x.device).unsqueeze(1)
    values = values.masked_fill(rank >= k_t, -math.inf)
    return torch.full_like(x, -math.inf).scatter_(1, ids, values)


def _top_k_top_p(x: torch.Tensor, k: Sequence[int], p: Sequence[float]) -> torch.Tensor:
    """Top-k (``k[i] == 0`` is off) then top-p on each row, by one full sort.

    Top-p keeps the smallest prefix of the sorted tokens whose probability reaches ``p[i]``: a
    token is dropped when the tokens before it already hold ``>= p[i]``, so the top one stays.
    """
    v = x.shape[1]
    sorted_x, ids = x.sort(dim=-1, descending=True)
    rank = torch.arange(v, device=x.device)
    k_t = upload([kk if 0 < kk < v else v for kk in k], torch.long, x.device).unsqueeze(1)
    sorted_x.masked_fill_(rank >= k_t, -math.inf)
    probs = torch.softmax(sorted_x, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    p_t = upload(p, x.dtype, x.device).unsqueeze(1)
    drop = before >= p_t
    drop[:, 0] = False
    sorted_x.masked_fill_(drop, -math.inf)
    return torch.empty_like(x).scatter_(1, ids, sorted_x)


def _min_p(x: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p[i]`` times the row's largest.

    ``prob[t] / prob[max] = exp(x[t] - x[max])``, so this is a threshold on logits (no softmax).
    """
    log_min_p = upload([math.log(m) for m in min_p], x.dtype, x.device)
    threshold = x.max(dim=-1, keepdim=True).values + log_min_p.unsqueeze(1)
    return x.masked_fill(x < threshold, -math.inf)


def race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of ``probs`` (which it overwrites) as ``argmax(probs / E)``.

    ``E ~ Exponential(1)`` is made as ``-log(U)``, ``U ~ Uniform[0, 1)``: ``uniform_`` stays below
    1 on CPU and CUDA, so ``E > 0`` and ``p / E`` is never 0/0 = nan (``E = inf`` merely gives 0).
    This is also about 3x faster on CPU than ``Tensor.exponential_``. Unseeded rows share one
    draw from the default generator; each seeded row then redraws its own ``U`` from its own
    generator (one launch per seeded row; the rest stays batched).
    """
    u = torch.empty_like(probs)
    if any(g is None for g in generators):
        u.uniform_()
    for i, g in enumerate(generators):
        if g is not None:
            u[i].uniform_(generator=g)
    return probs.div_(u.log_().neg_()).argmax(dim=-1)
