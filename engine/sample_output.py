"""A step's sampled tokens: on the device for the next step, on their way to the host for the
outputs.

The sampler leaves its tokens on the device (``PendingSample.tokens``: with async scheduling
the next step's input ids are gathered from them there) and starts one copy to the host of
everything the outputs need: the token ids and, for rows that asked, their logprobs and top
logprobs, packed in one float64 tensor (float64 holds every token id and float32 logprob
exactly). ``result()`` waits for that copy, the step's one host sync, and unpacks it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.device_io import HostCopy, upload
from engine.sampling_params import SamplingParams, TokenLogprob


@dataclass(slots=True)
class SamplerOutput:
    """One chosen token per row, and its logprobs where the row asked for them (else ``None``)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class PendingSample:
    """Sampled token ids on the device (``tokens``, int64 ``[rows]``) and their copy to the
    host under way; ``result()`` waits for the copy once and keeps what it unpacked."""

    def __init__(
        self, tokens: torch.Tensor, packed: torch.Tensor, unpack: Callable[[list], SamplerOutput]
    ) -> None:
        self.tokens = tokens
        self._copy = HostCopy(packed)
        self._unpack = unpack
        self._result: SamplerOutput | None = None

    def wait(self) -> None:
        """Block until the device has run the step (its copy landed); read nothing."""
        self._copy.wait()

    def result(self) -> SamplerOutput:
        if self._result is None:
            self._result = self._unpack(self._copy.wait().tolist())
        return self._result


def pending_output(
    tokens: torch.Tensor,
    raw_logprobs: torch.Tensor | None,
    want_lp: Sequence[int],
    params: Sequence[SamplingParams],
) -> PendingSample:
    """Start the host copy of ``tokens`` (and of the logprobs of rows ``want_lp``, from
    ``raw_logprobs``: the log-softmax of those rows' raw logits, in ``want_lp`` order)."""
    n = tokens.shape[0]
    if raw_logprobs is None:
        return PendingSample(tokens, tokens, lambda flat: SamplerOutput(flat, [None] * n))
    column = tokens.unsqueeze(1)
    chosen = column if len(want_lp) == n else column[upload(want_lp, torch.long, tokens.device)]
    chosen_lp = raw_logprobs.gather(1, chosen).squeeze(1)
    k_max = min(max(params[i].logprobs or 0 for i in want_lp), raw_logprobs.shape[1])
    top_lp, top_ids = raw_logprobs.topk(k_max, dim=-1)
    parts = (tokens, chosen_lp, top_lp.flatten(), top_ids.flatten())
    packed = torch.cat([t.to(torch.float64) for t in parts])

    def unpack(flat: list[float]) -> SamplerOutput:
        m = len(want_lp)
        token_ids = [int(t) for t in flat[:n]]
        lp_values = flat[n : n + m]
        top_values = flat[n + m : n + m + m * k_max]
        top_tokens = flat[n + m + m * k_max :]
        logprobs: list[TokenLogprob | None] = [None] * n
        for j, i in enumerate(want_lp):
            k = params[i].logprobs or 0
            start = j * k_max
            top = tuple(
                (int(top_tokens[start + c]), top_values[start + c]) for c in range(min(k, k_max))
            )
            logprobs[i] = TokenLogprob(token_ids[i], lp_values[j], top)
        return SamplerOutput(token_ids, logprobs)

    return PendingSample(tokens, packed, unpack)


def host_output(
    tokens: torch.Tensor,
    raw_logprobs: torch.Tensor | None,
    want_lp: Sequence[int],
    params: Sequence[SamplingParams],
) -> SamplerOutput:
    """``pending_output``, waited for: tokens and logprobs on the host in one transfer."""
    return pending_output(tokens, raw_logprobs, want_lp, params).result()
