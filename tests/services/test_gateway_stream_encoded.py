"""The gateway's per-token fast paths give what the general ones give: a stream's chunks as
JSON text (``stream_chunks(..., encoded=True)``) are byte for byte the chunks the dict path
serializes, and a plain TokenEvent decodes to the same BackendEvent as through the full path."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from tandem.v1 import common_pb2

from engine.sampling_params import SamplingParams
from services.gateway.codec import decode_event
from services.gateway.core import BackendEvent, BackendRequest, Usage
from services.gateway.prepare import Prepared
from services.gateway.stream import chunk_json, stream_chunks

# Texts JSON escapes differently: quotes, backslashes, control characters, non-ASCII, emoji.
TEXTS = (" plain", ' "quoted"', " back\\slash", "\nnew\tline\x01", " café", " 中文", " 🙂", "")


def make_prepared(n: int = 1, include_usage: bool = True, kind: str = "chat") -> Prepared:
    req = BackendRequest("chatcmpl-1", (1, 2, 3), SamplingParams(max_tokens=20, n=n), model="m")
    return Prepared(req, kind, True, include_usage, None, created=1700000000, n=n)


def make_events(n: int) -> list[BackendEvent]:
    out = [BackendEvent((100 + k,), text, index=k % n) for k, text in enumerate(TEXTS * 2)]
    for i in range(n):
        out.append(BackendEvent((7,), " end", finish_reason="stop", usage=Usage(3, 9, 1), index=i))
    return out


async def _events(events: list[BackendEvent]) -> AsyncIterator[BackendEvent]:
    for ev in events:
        yield ev


def chunks(p: Prepared, events: list[BackendEvent], encoded: bool) -> list:
    async def run() -> list:
        gen = stream_chunks(p, _events(events[1:]), str, first=events[0], encoded=encoded)
        return [c async for c in gen]

    return asyncio.run(run())


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("include_usage", [True, False])
def test_encoded_chunks_are_the_dict_chunks_json(n: int, include_usage: bool) -> None:
    p, events = make_prepared(n, include_usage), make_events(n)
    plain = chunks(p, events, encoded=False)
    fast = chunks(p, events, encoded=True)
    assert [chunk_json(c) for c in fast] == [chunk_json(c) for c in plain]
    assert [json.loads(chunk_json(c)) for c in fast] == plain
    # The text chunks (every text but the empty one, twice) took the fast path.
    assert sum(isinstance(c, str) for c in fast) == 2 * (len(TEXTS) - 1)
    assert all(isinstance(c, dict) for c in plain)


def test_completions_and_logprobs_keep_the_dict_path() -> None:
    p = make_prepared(kind="completion")
    assert not any(isinstance(c, str) for c in chunks(p, make_events(1), encoded=True))


def test_chunk_json_is_compact_and_ascii() -> None:
    assert chunk_json({"a": [1, None], "b": "é"}) == '{"a":[1,null],"b":"\\u00e9"}'
    assert chunk_json('{"already":"json"}') == '{"already":"json"}'


def test_a_plain_token_event_decodes_as_through_the_full_path() -> None:
    pb = common_pb2.TokenEvent(request_id="r", token_ids=[5, 6], text=" hi", index=1)
    assert decode_event(pb) == BackendEvent((5, 6), " hi", index=1)
    done = common_pb2.TokenEvent(
        request_id="r", token_ids=[7], text=".", finish_reason=common_pb2.FINISH_REASON_STOP
    )
    done.usage.prompt_tokens, done.usage.completion_tokens = 3, 4
    got = decode_event(done)
    assert (got.finish_reason, got.usage) == ("stop", Usage(3, 4, 0))
    stop_token = common_pb2.TokenEvent(token_ids=[2], stop_token_id=2)
    assert decode_event(stop_token).stop_reason == 2
