"""Decode's messages <-> core types."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from tandem.v1 import common_pb2, worker_pb2

from engine.errors import InvalidRequestError
from engine.handoff import FirstToken
from services.common.codec import (
    event_from_output,
    event_to_pb,
    handle_from_pb,
    logprob_from_pb,
    priority_from_pb,
    sampling_from_pb,
)
from services.decode.core import DecodeJob

if TYPE_CHECKING:
    from engine.llm_engine import RequestOutput


def job_from_pb(req: worker_pb2.DecodeRequest) -> DecodeJob:
    job = DecodeJob(
        request_id=req.request_id,
        prompt=list(req.token_ids),
        params=sampling_from_pb(req.sampling),
        tenant=req.tenant,
        cached_tokens=req.cached_tokens,
        priority=priority_from_pb(req.priority),
        lora=req.lora,
        admitted=req.admitted,
        resumed=list(req.resumed_token_ids),
        slo_ttft_ms=req.slo.ttft_ms,
        slo_tpot_ms=req.slo.tpot_ms,
    )
    if job.resumed and job.params.n != 1:
        raise InvalidRequestError("resumed_token_ids go with n=1")
    if req.HasField("kv"):
        job.kv = handle_from_pb(req.kv)
        starts = [(req.first, req.generator_state)]
        starts += [(c.first, c.generator_state) for c in req.other_choices]
        if any(not ev.token_ids for ev, _ in starts):
            raise InvalidRequestError(
                "a DecodeRequest with kv must carry each choice's first token"
            )
        job.starts = [_first_token(ev, state) for ev, state in starts if not ev.finish_reason]
        if job.resumed:  # moved with its KV: every output token so far, the last one first
            if job.resumed[-1] != req.first.token_ids[0]:
                raise InvalidRequestError("a moved request's first token is its last output")
            job.starts = [replace(job.starts[0], earlier=tuple(job.resumed[:-1]))]
        job.first_token = req.first.token_ids[0]
        job.first_logprob = _first_token(req.first, b"").logprob
        job.generator_state = req.generator_state
    return job


def _first_token(ev: common_pb2.TokenEvent, generator_state: bytes) -> FirstToken:
    lp = logprob_from_pb(ev.logprobs[0]) if ev.logprobs else None
    return FirstToken(ev.index, ev.token_ids[0], lp, generator_state)


def output_to_pb(out: RequestOutput, job: DecodeJob) -> common_pb2.TokenEvent:
    """One engine output of ``job`` as a TokenEvent. A prefilled job's last event counts its
    first token (sampled by the prefill worker) and the cache hits on both sides."""
    ev = event_from_output(out)
    if out.finished and job.kv is not None:
        ev.completion_tokens = len(out.token_ids)
        ev.cached_tokens = max(job.cached_tokens, out.num_cached_tokens)
    return event_to_pb(ev)
