"""Decode's messages <-> core types."""

from __future__ import annotations

from tandem.v1 import worker_pb2

from services.common.codec import (
    handle_from_pb,
    logprob_from_pb,
    priority_from_pb,
    sampling_from_pb,
)
from services.decode.core import DecodeJob


def job_from_pb(req: worker_pb2.DecodeRequest) -> DecodeJob:
    job = DecodeJob(
        request_id=req.request_id,
        prompt=list(req.token_ids),
        params=sampling_from_pb(req.sampling),
        tenant=req.tenant,
        cached_tokens=req.cached_tokens,
        priority=priority_from_pb(req.priority),
    )
    if req.HasField("kv"):
        job.kv = handle_from_pb(req.kv)
        job.first_token = req.first.token_ids[0] if req.first.token_ids else None
        if req.first.logprobs:
            job.first_logprob = logprob_from_pb(req.first.logprobs[0])
        job.generator_state = req.generator_state
        if job.first_token is None:
            from engine.errors import InvalidRequestError

            raise InvalidRequestError("a DecodeRequest with kv must carry the first token")
    return job
