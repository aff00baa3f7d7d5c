"""Turning a step's sampled tokens into outputs: detokenize, follow the grammar, check stops,
finish choices, and hold a prefill's blocks for its decode worker."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from engine.choices import Choice, Request
from engine.detokenizer import DetokenizerDelta
from engine.request_output import RequestOutput
from engine.sampling_params import TokenLogprob
from engine.sequence import FinishReason, SeqStatus, Sequence

if TYPE_CHECKING:
    from engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Emitter:
    """Turns each step's sampled tokens into outputs, under the engine lock; a part the engine
    holds.

    ``requests`` is the engine's table of live requests (a request leaves it when done);
    ``held`` and ``held_seqs`` its tables of prefill hand-offs (``engine.handoff``), which a
    request joins after its first tokens; ``scheduler`` finishes and detaches sequences. Counts
    the prompt tokens it has seen and those served from the prefix cache."""

    def __init__(
        self,
        scheduler: Scheduler,
        requests: dict[str, Request],
        held: set[str],
        held_seqs: dict[str, dict[int, Sequence]],
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.scheduler, self.max_model_len, self.eos_token_ids = (
            scheduler, max_model_len, eos_token_ids
        )  # fmt: skip
        self._requests, self._held, self._held_seqs = requests, held, held_seqs
        self.prefix_hit_tokens = 0
        self.prompt_tokens = 0

    def emit(
        self,
        due: list[Sequence],
        tokens: Seq[Seq[int]],
        logprobs: Seq[Seq[TokenLogprob | None]],
    ) -> list[RequestOutput]:
        """One output per sampled sequence, in order (with the tokens it produced this step:
        one, or kept draft tokens and one more); then settle each request touched."""
        outputs: list[RequestOutput] = []
        by_request: dict[str, list[RequestOutput]] = {}
        for seq, toks, lps in zip(due, tokens, logprobs, strict=True):
            req = self._requests[seq.request_id]
            out = self._on_tokens(req, req.live[seq.index], toks, lps)
            outputs.append(out)
            by_request.setdefault(seq.request_id, []).append(out)
        for rid, outs in by_request.items():
            req = self._requests[rid]
            if req.hold_kv:
                self._hold(req, outs)
            if req.done:
                del self._requests[rid]
                for out in outs[:-1]:
                    out.others_pending = True
            else:
                for out in outs:
                    out.others_pending = True
        return outputs

    def _on_tokens(
        self, req: Request, choice: Choice, tokens: Seq[int], lps: Seq[TokenLogprob | None]
    ) -> RequestOutput:
        """Append a step's tokens up to the first that finishes the choice (the rest are
        dropped)."""
        seq = choice.seq
        if not seq.output_token_ids and seq is req.parent:
            self.prefix_hit_tokens += seq.num_cached_prompt_tokens
            self.prompt_tokens += len(seq.prompt_token_ids)
        new_ids: list[int] = []
        new_lps: list[TokenLogprob] = []
        new_text = ""
        for token, lp in zip(tokens, lps, strict=True):
            seq.output_token_ids.append(token)
            new_ids.append(token)
            if choice.logprobs is not None and lp is not None:
                choice.logprobs.append(lp)
                new_lps.append(lp)
            if self._stop_token(seq, token) and not seq.params.include_stop_str_in_output:
                delta = DetokenizerDelta("", None)  # vLLM's: the stop token's text is left out
            else:
                delta = choice.detok.push([token])
            new_text += delta.text
            reason = self._finish_reason(choice, token, delta.stop_matched)
            if reason is not None:
                break
        if reason is not None:
            if reason is not FinishReason.STOP or delta.stop_matched is None:
                new_text += choice.detok.flush()
                if choice.detok.stop_matched is not None:  # a stop hidden behind a partial char
                    reason, choice.stop_reason = FinishReason.STOP, choice.detok.stop_matched
            if req.hold_kv:  # the prompt's blocks are settled once every choice has its token
                seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
            else:
                self.scheduler.finish(seq, reason)
            del req.live[seq.index]
        choice.text += new_text
        return self.output(choice, new_ids, new_text, new_lps)

    def _stop_token(self, seq: Sequence, token: int) -> bool:
        """Whether ``token`` (just appended) ends ``seq``: one of its ``stop_token_ids``, or an
        EOS unless it ignores them, past its ``min_tokens`` (the sampler masks them before)."""
        p = seq.params
        if len(seq.output_token_ids) < p.min_tokens:
            return False
        return token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)

    def _finish_reason(self, choice: Choice, token: int, stop: str | None) -> FinishReason | None:
        seq, p = choice.seq, choice.seq.params
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            # The mask allows only tokens the matcher accepts, so this is a bug, not bad input.
            log.error("request %s left its grammar: %s", seq.request_id, seq.matcher.get_error())
            choice.stop_reason = "grammar error"
            return FinishReason.ABORT
        if stop is not None:
            choice.stop_reason = stop
            return FinishReason.STOP
        if self._stop_token(seq, token):
            if token in p.stop_token_ids:
                choice.stop_reason = token  # vLLM's: the stop token's id
            return FinishReason.STOP  # at the model's EOS no stop reason, as in vLLM
        if p.ignore_eos and seq.matcher is not None and seq.matcher.is_stopped():
            return FinishReason.STOP  # the grammar is complete: nothing but EOS could follow
        # num_known: the token after this one may already be in flight (async scheduling).
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_known >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _hold(self, req: Request, outs: list[RequestOutput]) -> None:
        """After a prefill's first tokens: keep the prompt's blocks for the decode worker while
        any choice goes on (``kv_held``), else free them. The request leaves this engine."""
        parent = req.parent
        if req.live:
            self.scheduler.detach(parent)
            self._held.add(parent.request_id)
            self._held_seqs[parent.request_id] = {i: c.seq for i, c in req.live.items()}
            for out in outs:
                out.kv_held = out.index in req.live
        else:
            reason = parent.finish_reason
            assert reason is not None
            self.scheduler.finish(parent, reason)
        req.live.clear()

    def output(
        self,
        choice: Choice,
        new_ids: list[int],
        new_text: str,
        new_lps: list[TokenLogprob],
    ) -> RequestOutput:
        seq = choice.seq
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=choice.text,
            new_token_ids=new_ids,
            new_text=new_text,
            new_logprobs=new_lps,
            logprobs=choice.logprobs,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            stop_reason=choice.stop_reason,
            index=seq.index,
        )
