"""Prefill's messages <-> core types (with services.common.codec, the only pb2 users here)."""

from __future__ import annotations

from tandem.v1 import worker_pb2

from services.common.codec import event_from_output, event_to_pb, handle_to_pb
from services.prefill.core import PrefillResult


def prefill_response(result: PrefillResult) -> worker_pb2.PrefillResponse:
    first = result.first
    ev = event_from_output(first)
    if first.kv_held:  # the request goes on: usage comes from the decode worker
        ev.finish_reason = None
    msg = worker_pb2.PrefillResponse(
        first=event_to_pb(ev),
        generator_state=result.generator_state,
        cached_tokens=first.num_cached_tokens,
    )
    if result.handle is not None:
        msg.kv.CopyFrom(handle_to_pb(result.handle))
    return msg
