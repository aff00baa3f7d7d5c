"""Prefill's messages <-> core types (with services.common.codec, the only pb2 users here)."""

from __future__ import annotations

from tandem.v1 import worker_pb2

from engine.llm_engine import RequestOutput
from services.common.codec import event_from_output, event_to_pb, handle_to_pb
from services.prefill.core import PrefillResult


def _first_pb(out: RequestOutput):
    ev = event_from_output(out)
    if out.kv_held:  # the choice goes on: usage comes from the decode worker
        ev.finish_reason = None
    return event_to_pb(ev)


def prefill_response(result: PrefillResult) -> worker_pb2.PrefillResponse:
    first = result.first
    msg = worker_pb2.PrefillResponse(
        first=_first_pb(first),
        generator_state=result.generator_states[0],
        cached_tokens=first.num_cached_tokens,
        other_choices=[
            worker_pb2.ChoiceStart(first=_first_pb(out), generator_state=state)
            for out, state in zip(result.firsts[1:], result.generator_states[1:], strict=True)
        ],
    )
    if result.handle is not None:
        msg.kv.CopyFrom(handle_to_pb(result.handle))
    return msg
