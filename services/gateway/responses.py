"""Builders of OpenAI response objects (plain dicts, ready for JSON) from gateway results.

Usage counts are the gateway's own: ``prompt_tokens`` is the length of the tokenized prompt it
sent, ``completion_tokens`` the number of token ids it received; only ``cached_tokens`` comes
from the backend. Logprob token strings are single-id decodes (special tokens kept).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import aclosing
from typing import Any

from engine.tokenizer import Tokenizer
from services.gateway.core import BackendEvent, Generation, TokenLogprob, check_event, unfinished
from services.gateway.prepare import Prepared


class TokenText:
    """id -> text of that one token, cached (the cache is bounded by the vocabulary)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(
    entries: Iterable[TokenLogprob], text_of: TokenText, k: int
) -> dict[str, Any] | None:
    """``choices[].logprobs`` of a chat completion: ``{"content": [{token, logprob, bytes,
    top_logprobs}]}``."""

    def one(tid: int, lp: float) -> dict[str, Any]:
        s = text_of(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top[:k]]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """``choices[].logprobs`` of text completions; keeps ``text_offset`` running across chunks
    (offsets count characters of the single-token strings, as vLLM does)."""

    def __init__(self, text_of: TokenText, k: int) -> None:
        self._text_of, self._k, self._offset = text_of, k, 0

    def __call__(self, entries: Iterable[TokenLogprob]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for e in entries:
            s = self._text_of(e.token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self._text_of(t): lp for t, lp in e.top[: self._k]})
            out["text_offset"].append(self._offset)
            self._offset += len(s)
        return out


def _head(p: Prepared, obj: str) -> dict[str, Any]:
    return {
        "id": p.request_id,
        "object": obj,
        "created": p.created,
        "model": p.backend_request.model,
        "system_fingerprint": None,
    }


def full_response(p: Prepared, gen: Generation, text_of: TokenText) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion`` object for a finished generation."""
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": gen.finish_reason,
        "stop_reason": gen.stop_reason,
        "logprobs": None,
    }
    if p.kind == "chat":
        choice["message"] = {"role": "assistant", "content": gen.text, "refusal": None}
        if p.top_logprobs is not None:
            choice["logprobs"] = chat_logprobs(gen.logprobs, text_of, p.top_logprobs)
        obj = "chat.completion"
    else:
        choice["text"] = gen.text
        if p.top_logprobs is not None:
            choice["logprobs"] = CompletionLogprobs(text_of, p.top_logprobs)(gen.logprobs)
        obj = "text_completion"
    return {
        **_head(p, obj),
        "choices": [choice],
        "usage": usage(p.prompt_len, gen.num_tokens, gen.cached_tokens),
    }


async def stream_chunks(
    p: Prepared,
    events: AsyncIterator[BackendEvent],
    text_of: TokenText,
    first: BackendEvent | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """The chunks of a streamed response, in order (``first``, if given, was taken from
    ``events`` already). Chat starts with a ``delta.role`` chunk; events carrying no text,
    logprobs or finish are skipped; with ``include_usage`` every chunk has ``usage: null`` and a
    last chunk has empty ``choices`` and the usage."""
    chat = p.kind == "chat"
    head = _head(p, "chat.completion.chunk" if chat else "text_completion")
    extra = {"usage": None} if p.include_usage else {}
    comp_lp = CompletionLogprobs(text_of, p.top_logprobs or 0)

    def chunk(text: str | None, ev: BackendEvent | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
        if chat:
            choice["delta"] = {"role": "assistant", "content": ""} if ev is None else {}
            if text:
                choice["delta"]["content"] = text
        else:
            choice["text"] = text or ""
        if ev is not None:
            if p.top_logprobs is not None and ev.logprobs:
                lp = ev.logprobs
                choice["logprobs"] = (
                    chat_logprobs(lp, text_of, p.top_logprobs) if chat else comp_lp(lp)
                )
            choice["finish_reason"] = ev.finish_reason
            if ev.finish_reason is not None:
                choice["stop_reason"] = ev.stop_reason
        return {**head, "choices": [choice], **extra}

    if chat:
        yield chunk(None, None)
    completion_tokens = cached = 0
    finished = False
    async with aclosing(_prepend(first, events)) as all_events:
        async for ev in all_events:
            check_event(ev)
            finished = ev.finish_reason is not None
            completion_tokens += len(ev.token_ids)
            if ev.usage is not None:
                cached = ev.usage.cached_tokens
            wants_lp = p.top_logprobs is not None and ev.logprobs
            if ev.text or finished or wants_lp:
                yield chunk(ev.text, ev)
    if not finished:
        raise unfinished()
    if p.include_usage:
        yield {**head, "choices": [], "usage": usage(p.prompt_len, completion_tokens, cached)}


async def _prepend(
    first: BackendEvent | None, events: AsyncIterator[BackendEvent]
) -> AsyncGenerator[BackendEvent, None]:
    if first is not None:
        yield first
        if first.finish_reason is not None:
            return
    async for ev in events:
        yield ev
