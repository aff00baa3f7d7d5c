"""Builders of OpenAI response objects (plain dicts, ready for JSON) from gateway results.

Usage counts are the gateway's own: ``prompt_tokens`` is the length of the tokenized prompt it
sent, ``completion_tokens`` the number of token ids it received; only ``cached_tokens`` comes
from the backend. Logprob token strings are single-id decodes (special tokens kept).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from engine.tokenizer import Tokenizer
from services.gateway.core import Generation, TokenLogprob
from services.gateway.prepare import Prepared
from services.gateway.tool_parser import ToolCallParser, merge


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


TokenName = Callable[[int], str]  # a token id's name in logprobs (TokenText, or its id)


def token_names(p: Prepared, text_of: TokenName) -> TokenName:
    """How logprobs name a token: its text, or ``token_id:ID`` with vLLM's
    ``return_tokens_as_token_ids`` (which tells apart tokens of the same text)."""
    return _as_id if p.tokens_as_ids else text_of


def _as_id(token_id: int) -> str:
    return f"token_id:{token_id}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(
    entries: Iterable[TokenLogprob], text_of: TokenName, k: int
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

    def __init__(self, text_of: TokenName, k: int) -> None:
        self._text_of, self._k, self._offset = text_of, k, 0

    def __call__(self, entries: Iterable[TokenLogprob]) -> dict[str, Any]:
        out = _no_entries()
        for e in entries:
            top = {self._text_of(t): lp for t, lp in e.top[: self._k]}
            self._add(out, e.token_id, e.logprob, top)
        return out

    def prompt(self, token_ids: Sequence[int], scored: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The entries of an echoed prompt: its first token has no logprob (nothing comes
        before it), the others the scoring pass's (``scored``: one per token after the first)."""
        out = _no_entries()
        if token_ids:
            self._add(out, token_ids[0], None, None)
        tail = self(scored)
        return {key: out[key] + tail[key] for key in out}

    def _add(
        self, out: dict[str, list[Any]], token_id: int, lp: float | None, top: dict | None
    ) -> None:
        s = self._text_of(token_id)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self._offset)
        self._offset += len(s)


def _no_entries() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def prompt_logprobs(
    token_ids: Sequence[int], scored: Sequence[TokenLogprob], k: int, text_of: TokenName
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first token, then for each token a dict
    by token id of that token and the ``k`` most likely at its place, each with its logprob,
    rank and text."""

    def one(lp: float, rank: int, token_id: int) -> dict[str, Any]:
        return {"logprob": lp, "rank": rank, "decoded_token": text_of(token_id)}

    out: list[dict[str, dict[str, Any]] | None] = [None] if token_ids else []
    for e in scored:
        place = {str(e.token_id): one(e.logprob, e.rank, e.token_id)}
        for r, (t, lp) in enumerate(e.top[:k], start=1):
            place.setdefault(str(t), one(lp, r, t))
        out.append(place)
    return out


def head(p: Prepared, obj: str) -> dict[str, Any]:
    return {
        "id": p.request_id,
        "object": obj,
        "created": p.created,
        "model": p.backend_request.model,
        "system_fingerprint": None,
    }


def full_response(
    p: Prepared,
    gens: list[Generation],
    text_of: TokenName,
    scored: Sequence[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion`` object for finished generations (one per
    sampled choice; with ``best_of``, the ``p.n`` most likely per token are answered).
    ``scored``: the prompt's scoring pass, where ``p.score_k`` asked for one."""
    text_of = token_names(p, text_of)
    chosen = best_choices(gens, p.n) if p.best_of else gens
    chat = p.kind == "chat"
    choices = [
        _chat_choice(p, i, gen, text_of) if chat else _text_choice(p, i, gen, text_of, scored)
        for i, gen in enumerate(chosen)
    ]
    out = {
        **head(p, "chat.completion" if chat else "text_completion"),
        "choices": choices,
        "usage": usage(
            p.prompt_len, sum(g.num_tokens for g in gens), max(g.cached_tokens for g in gens)
        ),
    }
    if chat and p.prompt_logprobs is not None:  # vLLM answers them beside the choices in chat
        ids = p.backend_request.token_ids
        out["prompt_logprobs"] = prompt_logprobs(ids, scored or (), p.prompt_logprobs, text_of)
    return out


def best_choices(gens: list[Generation], n: int) -> list[Generation]:
    """The ``n`` generations with the highest mean token logprob, best first."""

    def mean_logprob(g: Generation) -> float:
        return sum(lp.logprob for lp in g.logprobs) / max(len(g.logprobs), 1)

    return sorted(gens, key=mean_logprob, reverse=True)[:n]


def _base_choice(i: int, gen: Generation, finish_reason: str | None) -> dict[str, Any]:
    return {
        "index": i,
        "finish_reason": finish_reason,
        "stop_reason": gen.stop_reason,
        "logprobs": None,
    }


def _chat_choice(p: Prepared, i: int, gen: Generation, text_of: TokenName) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": gen.text, "refusal": None}
    finish = gen.finish_reason
    if p.tools is not None and p.tools.parse:
        parser = ToolCallParser(p.tools.parser)
        content, calls = merge([parser.feed(gen.text), parser.finish()])
        message["content"] = content or None
        if calls:
            message["tool_calls"] = calls
            finish = tool_finish(finish)
    choice = _base_choice(i, gen, finish)
    choice["message"] = message
    if p.top_logprobs is not None:
        choice["logprobs"] = chat_logprobs(gen.logprobs, text_of, p.top_logprobs)
    return choice


def _text_choice(
    p: Prepared,
    i: int,
    gen: Generation,
    text_of: TokenName,
    scored: Sequence[TokenLogprob] | None,
) -> dict[str, Any]:
    choice = _base_choice(i, gen, gen.finish_reason)
    choice["text"] = gen.text if p.echo is None else p.echo + gen.text
    ids = p.backend_request.token_ids
    if p.top_logprobs is not None:
        lp = CompletionLogprobs(text_of, p.top_logprobs)
        if p.echo is None:
            choice["logprobs"] = lp(gen.logprobs)
        else:
            head, tail = lp.prompt(ids, scored or ()), lp(gen.logprobs)
            choice["logprobs"] = {key: head[key] + tail[key] for key in head}
    if p.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(ids, scored or (), p.prompt_logprobs, text_of)
    return choice


def tool_finish(finish_reason: str | None) -> str | None:
    """A choice that called tools and stopped by itself finished with ``tool_calls``."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
