"""The chunks of a streamed response: one ``delta`` per event of each choice, tool calls as
OpenAI tool-call deltas, an optional last chunk with the usage of every choice."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from services.gateway.core import BackendEvent, TokenLogprob, check_event, unfinished
from services.gateway.prepare import Prepared
from services.gateway.responses import (
    CompletionLogprobs,
    TokenName,
    chat_logprobs,
    head,
    token_names,
    tool_finish,
    usage,
)
from services.gateway.tool_parser import CallDelta, Parsed, ToolCallParser


@dataclass(slots=True)
class _ChoiceStream:
    """What one choice of a stream carries from event to event."""

    parser: ToolCallParser | None
    logprobs: CompletionLogprobs
    called: bool = False  # emitted a tool call


@dataclass(slots=True)
class _Totals:
    completion_tokens: int = 0
    cached_tokens: int = 0
    pending: set[int] = field(default_factory=set)


async def stream_chunks(
    p: Prepared,
    events: AsyncIterator[BackendEvent],
    text_of: TokenName,
    first: BackendEvent | None = None,
    scored: Sequence[TokenLogprob] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """The chunks of a streamed response, in order (``first``, if given, was taken from
    ``events`` already). Chat starts with a ``delta.role`` chunk per choice, and completions
    with ``echo`` with a chunk per choice holding the prompt (and, with logprobs, its tokens'
    from ``scored``, the prompt's scoring pass); events carrying no text, tool call, logprobs
    or finish are skipped; with ``include_usage`` every chunk has ``usage: null`` (with
    ``continuous_usage``: the usage so far) and a last chunk has empty ``choices`` and the usage
    of all choices."""
    chat = p.kind == "chat"
    text_of = token_names(p, text_of)
    top = head(p, "chat.completion.chunk" if chat else "text_completion")
    totals = _Totals(pending=set(range(p.n)))

    def extra() -> dict[str, Any]:
        if not p.include_usage:
            return {}
        if not p.continuous_usage:
            return {"usage": None}
        return {"usage": usage(p.prompt_len, totals.completion_tokens, totals.cached_tokens)}

    parse = chat and p.tools is not None and p.tools.parse
    states = [
        _ChoiceStream(
            ToolCallParser(p.tools.parser) if parse and p.tools else None,
            CompletionLogprobs(text_of, p.top_logprobs or 0),
        )
        for _ in range(p.n)
    ]
    if chat:
        for i in range(p.n):
            delta = {"role": "assistant", "content": ""}
            yield {**top, "choices": [_choice(i, {"delta": delta})], **extra()}
    elif p.echo is not None:
        for i in range(p.n):
            body: dict[str, Any] = {"text": p.echo}
            if p.top_logprobs is not None:
                ids = p.backend_request.token_ids
                body["logprobs"] = states[i].logprobs.prompt(ids, scored or ())
            yield {**top, "choices": [_choice(i, body)], **extra()}
    async with aclosing(_prepend(first, events)) as all_events:
        async for ev in all_events:
            check_event(ev)
            totals.completion_tokens += len(ev.token_ids)
            if ev.usage is not None:
                totals.cached_tokens = ev.usage.cached_tokens
            if ev.finish_reason is not None:
                totals.pending.discard(ev.index)
            body = _event_body(p, states[ev.index], ev, text_of) if ev.index < p.n else None
            if body is not None:
                yield {**top, "choices": [_choice(ev.index, body)], **extra()}
    if totals.pending:
        raise unfinished()
    if p.include_usage:
        counts = usage(p.prompt_len, totals.completion_tokens, totals.cached_tokens)
        yield {**top, "choices": [], "usage": counts}


def _choice(index: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"index": index, "logprobs": None, "finish_reason": None, **body}


def _event_body(
    p: Prepared, st: _ChoiceStream, ev: BackendEvent, text_of: TokenName
) -> dict[str, Any] | None:
    """The choice fields of the chunk for ``ev`` (None: nothing to send)."""
    finished = ev.finish_reason is not None
    wants_lp = p.top_logprobs is not None and bool(ev.logprobs)
    body: dict[str, Any] = {}
    if p.kind == "chat":
        delta = _chat_delta(st, ev.text, finished)
        if not (delta or finished or wants_lp):
            return None
        body["delta"] = delta
    else:
        if not (ev.text or finished or wants_lp):
            return None
        body["text"] = ev.text
    if wants_lp:
        lp = ev.logprobs
        body["logprobs"] = (
            chat_logprobs(lp, text_of, p.top_logprobs or 0) if p.kind == "chat" else st.logprobs(lp)
        )
    if finished:
        body["finish_reason"] = tool_finish(ev.finish_reason) if st.called else ev.finish_reason
        body["stop_reason"] = ev.stop_reason
    return body


def _chat_delta(st: _ChoiceStream, text: str, finished: bool) -> dict[str, Any]:
    if st.parser is None:
        return {"content": text} if text else {}
    parsed = st.parser.feed(text)
    if finished:
        rest = st.parser.finish()
        parsed = Parsed(parsed.content + rest.content, parsed.calls + rest.calls)
    delta: dict[str, Any] = {}
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.calls:
        st.called = True
        delta["tool_calls"] = [_call_delta(c) for c in parsed.calls]
    return delta


def _call_delta(c: CallDelta) -> dict[str, Any]:
    if c.id is None:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    return {
        "index": c.index,
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    }


async def _prepend(
    first: BackendEvent | None, events: AsyncIterator[BackendEvent]
) -> AsyncGenerator[BackendEvent, None]:
    if first is not None:
        yield first
    async for ev in events:
        yield ev
