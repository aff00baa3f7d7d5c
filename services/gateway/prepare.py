"""Turning an OpenAI request into a validated, tokenized ``BackendRequest``.

Sync on purpose: templating and tokenizing are CPU work that ``server`` runs in a worker thread.
Limits are checked here, in the order a client would fix them: model, unsupported options,
prompt shape, context length, then sampling ranges (``engine.sampling_params`` owns those).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from engine.tokenizer import Tokenizer
from services.gateway.core import APIError, BackendRequest, GatewayConfig
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to run, plus what the response builders need."""

    backend_request: BackendRequest
    kind: str  # "chat" or "completion"
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs in the response
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def request_id(self) -> str:
        return self.backend_request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.backend_request.token_ids)


def prepare_chat(
    cfg: GatewayConfig, tok: Tokenizer, body: ChatCompletionRequest, request_id: str, tenant: str
) -> Prepared:
    """Validate a chat request, apply the chat template (content is data, never template code)
    and tokenize it."""
    _check_common(cfg, body)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        _check_range("top_logprobs", body.top_logprobs, 0, MAX_TOP_LOGPROBS)
    messages = [_message_dict(i, m) for i, m in enumerate(body.messages)]
    try:
        ids = tok.encode_chat(messages)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="messages") from e
    except Exception as e:  # a template that fails on these messages (e.g. wrong role order)
        raise APIError(400, f"chat template failed on these messages: {e}", param="messages") from e
    top = (body.top_logprobs or 0) if body.logprobs else None
    return _prepare(cfg, body, ids, top, request_id, tenant)


def prepare_completion(
    cfg: GatewayConfig, tok: Tokenizer, body: CompletionRequest, request_id: str, tenant: str
) -> Prepared:
    """Validate a text-completion request and tokenize its prompt (no special tokens added)."""
    _check_common(cfg, body)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if body.best_of not in (None, 1):
        raise APIError(400, "best_of > 1 is not supported", param="best_of")
    if body.logprobs is not None:
        _check_range("logprobs", body.logprobs, 0, MAX_TOP_LOGPROBS)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "prompt: a list of strings must hold exactly one", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tok.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        vocab = tok.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is not in [0, {vocab})", param="prompt")
    return _prepare(cfg, body, ids, body.logprobs, request_id, tenant)


def _prepare(
    cfg: GatewayConfig,
    body: ChatCompletionRequest | CompletionRequest,
    ids: Sequence[int],
    top_logprobs: int | None,
    request_id: str,
    tenant: str,
) -> Prepared:
    """Check the prompt against the context, default max_tokens, build the sampling params."""
    chat = isinstance(body, ChatCompletionRequest)
    prompt_param = "messages" if chat else "prompt"
    max_tokens, max_tokens_param = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, max_tokens_param = body.max_completion_tokens, "max_completion_tokens"
    n, ctx = len(ids), cfg.max_model_len
    if n == 0:
        raise APIError(400, f"{prompt_param} must not be empty", param=prompt_param)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{max_tokens_param} must be >= 1", param=max_tokens_param)
    if n >= ctx or (max_tokens is not None and n + max_tokens > ctx):
        asked = n + (max_tokens or 0)
        raise APIError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{asked} tokens ({n} in the {prompt_param}, {max_tokens or 0} in the completion), "
            f"and at least 1 completion token must fit. Please reduce the length of the "
            f"{prompt_param} or completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(ctx - n, cfg.default_max_tokens)
    sampling = _sampling(body, max_tokens, top_logprobs)
    req = BackendRequest(
        request_id,
        tuple(ids),
        sampling,
        tenant,
        cfg.served_model_name,
        body.priority or "interactive",
        time.monotonic() + _timeout(cfg, body.timeout),
        session=body.user or "",
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    kind = "chat" if chat else "completion"
    return Prepared(req, kind, bool(body.stream), include_usage, top_logprobs)


def _check_common(cfg: GatewayConfig, body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.model != cfg.served_model_name:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist. This server serves "
            f"`{cfg.served_model_name}`.",
            param="model",
            code="model_not_found",
        )
    if body.n is not None and body.n != 1:
        raise APIError(400, "n > 1 is not supported" if body.n > 1 else "n must be 1", param="n")
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    if body.seed is not None:
        _check_range("seed", body.seed, INT64_MIN, INT64_MAX)


def _sampling(
    body: ChatCompletionRequest | CompletionRequest, max_tokens: int, top_logprobs: int | None
) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
    }
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=bool(body.ignore_eos),
            logprobs=top_logprobs,
            **kwargs,
        )
    except InvalidRequestError as e:  # messages read "<field>: <why> (got ...)"
        param = str(e).split(":", 1)[0]
        raise APIError(400, str(e), param=param if param.isidentifier() else None) from e


def _timeout(cfg: GatewayConfig, asked: float | None) -> float:
    """The request's time budget: the client's ``timeout`` (> 0) capped by the server's
    maximum, else the server's default."""
    if asked is None:
        return min(cfg.request_timeout, cfg.max_request_timeout)
    if not asked > 0:  # also NaN
        raise APIError(400, f"timeout must be > 0 seconds (got {asked})", param="timeout")
    return min(asked, cfg.max_request_timeout)


def _check_range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise APIError(400, f"{name} must be in [{lo}, {hi}] (got {value})", param=name)


def _message_dict(i: int, m: Any) -> dict[str, Any]:
    """A message as the template sees it: content flattened to one string ("" for null)."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise APIError(
                    400,
                    f"content part type {part.type!r} is not supported; only 'text' parts are",
                    param=f"messages.[{i}].content.[{j}].type",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    return out
