"""Turning an OpenAI request into a validated, tokenized ``BackendRequest``.

Sync on purpose: templating and tokenizing are CPU work that ``server`` runs in a worker thread.
Limits are checked here, in the order a client would fix them: model, unsupported options,
prompt shape, context length, then sampling ranges (``engine.sampling_params`` owns those).
A ``room`` check runs before the templating and tokenizing: under overload a request that
cannot fit whatever its prompt is refused (429) without that work (`Limits.check_room`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.grammar import GrammarSpec
from engine.sampling_params import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from engine.tokenizer import Tokenizer
from services.gateway.config import GatewayConfig
from services.gateway.core import APIError, BackendRequest
from services.gateway.schemas import (
    CHAT_NOT_IMPLEMENTED,
    NOT_IMPLEMENTED,
    ChatCompletionRequest,
    CompletionRequest,
)
from services.gateway.structured import response_format_grammar
from services.gateway.tools import ToolRequest, ToolSupport, template_messages, tool_request

NO_TOOLS = ToolSupport(None, why="this gateway has no tool support configured")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Raises 429 when a request costing at least this many tokens cannot be admitted now.
RoomCheck = Callable[[int], None]


def _no_room_check(least_cost: int) -> None:
    pass


def _least_cost(body: ChatCompletionRequest | CompletionRequest, choices: int) -> int:
    """The fewest tokens admission can book for ``body`` whatever its prompt: a one-token
    prompt and each choice's ``max_tokens`` (at least 1 when it is left to the default)."""
    asked = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        asked = body.max_completion_tokens
    return 1 + choices * max(asked or 1, 1)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to run, plus what the response builders need."""

    backend_request: BackendRequest
    kind: str  # "chat" or "completion"
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs in the response
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolRequest | None = None  # tool calls are read out of chat output
    n: int = 1  # choices in the response; best_of samples more and keeps the n best
    echo: str | None = None  # completions' echo: the prompt's text, put before each choice's
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the top k of each place
    generate: bool = True  # False: echo with max_tokens 0, which answers the prompt alone
    continuous_usage: bool = False  # every chunk of a stream carries the usage so far
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:ID" (vLLM's option)

    @property
    def score_k(self) -> int | None:
        """The top k of the prompt's scoring pass this response needs (None: it needs none):
        prompt logprobs, and echo with logprobs (whose prompt entries come from that pass)."""
        ks = [k for k in (self.prompt_logprobs, self.echo_logprobs) if k is not None]
        return max(ks) if ks else None

    @property
    def echo_logprobs(self) -> int | None:
        return self.top_logprobs if self.echo is not None else None

    @property
    def best_of(self) -> bool:
        """Whether more choices are sampled than answered (completions' ``best_of``)."""
        return self.backend_request.sampling.n > self.n

    @property
    def request_id(self) -> str:
        return self.backend_request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.backend_request.token_ids)


def prepare_chat(
    cfg: GatewayConfig,
    tok: Tokenizer,
    body: ChatCompletionRequest,
    request_id: str,
    tenant: str,
    tools: ToolSupport = NO_TOOLS,
    room: RoomCheck = _no_room_check,
) -> Prepared:
    """Validate a chat request, apply the chat template (content is data, never template code)
    and tokenize it. ``tools``: how this model calls tools (``tools.tool_support``)."""
    _check_common(cfg, body)
    for name, allowed in CHAT_NOT_IMPLEMENTED.items():
        if getattr(body, name) not in allowed:
            raise APIError(400, f"{name} is not supported by this server", param=name)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        _check_range("top_logprobs", body.top_logprobs, 0, MAX_TOP_LOGPROBS)
    req_tools = tool_request(tools, body.tools, body.tool_choice, body.parallel_tool_calls)
    grammar = response_format_grammar(body.response_format)
    if grammar is not None and req_tools is not None and req_tools.grammar is not None:
        raise APIError(
            400,
            "response_format cannot be combined with tool_choice 'required' or a named function",
            param="response_format",
        )
    if req_tools is not None and req_tools.grammar is not None:
        grammar = req_tools.grammar
    messages = [_message_dict(i, m) for i, m in enumerate(body.messages)]
    room(_least_cost(body, body.n or 1))
    ids = _encode_chat(tok, messages, tools, req_tools)
    top = (body.top_logprobs or 0) if body.logprobs else None
    return _prepare(cfg, body, ids, top, request_id, tenant, grammar, req_tools)


def chat_ids(
    tok: Tokenizer,
    messages: Sequence[Any],
    support: ToolSupport,
    req_tools: ToolRequest | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The token ids of chat ``messages`` (request models), as a chat request runs them."""
    dicts = [_message_dict(i, m) for i, m in enumerate(messages)]
    return _encode_chat(tok, dicts, support, req_tools, add_generation_prompt)


def _encode_chat(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    support: ToolSupport,
    req_tools: ToolRequest | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Template and tokenize; requests with tools, tool calls or tool results go through the
    tool template (their tool definitions and calls may not hold special-token text)."""
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if req_tools is not None or history:
        if support.parser is None:
            raise APIError(400, support.why, param="messages" if history else "tools")
        defined = req_tools.tools if req_tools is not None else []
        calls = [m.get("tool_calls") for m in messages]
        if tok.holds_special(json.dumps([defined, calls], ensure_ascii=False)):
            raise APIError(
                400, "tools and tool calls may not contain special-token text", param="tools"
            )
        messages = template_messages(messages)
        kwargs |= {"tools": defined, "template": support.template}
    try:
        return tok.encode_chat(messages, **kwargs)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="messages") from e
    except Exception as e:  # a template that fails on these messages (e.g. wrong role order)
        raise APIError(400, f"chat template failed on these messages: {e}", param="messages") from e


def prepare_completion(
    cfg: GatewayConfig,
    tok: Tokenizer,
    body: CompletionRequest,
    request_id: str,
    tenant: str,
    room: RoomCheck = _no_room_check,
) -> Prepared:
    """Validate a text-completion request and tokenize its prompt (with the tokenizer's own special
    tokens unless ``add_special_tokens`` is false, as vLLM).
    ``best_of`` samples that many choices and answers with the ``n`` most likely per token.
    ``echo`` puts the prompt before each choice (with logprobs, its tokens' logprobs first);
    with ``max_tokens`` 0 nothing is generated and the prompt alone is answered."""
    _check_common(cfg, body)
    echo_only = bool(body.echo) and body.max_tokens == 0
    if echo_only:
        if body.stream:
            raise APIError(
                400, "max_tokens 0 (echo the prompt alone) cannot be used with stream",
                param="max_tokens",
            )  # fmt: skip
        body = body.model_copy(update={"max_tokens": 1})  # checked as one token; never run
    if body.logprobs is not None:
        _check_range("logprobs", body.logprobs, 0, MAX_TOP_LOGPROBS)
    best_of = _best_of(body)
    prompt = body.prompt  # one prompt: `prepare_completions` splits a batch
    if _is_batch(prompt):
        raise APIError(400, "prompt: a batch of prompts goes through prepare_completions")
    room(_least_cost(body, best_of or body.n or 1))
    if isinstance(prompt, str):
        ids = tok.encode_prompt(prompt, add_special_tokens=body.add_special_tokens)
    else:
        ids = [int(t) for t in prompt]
        vocab = tok.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is not in [0, {vocab})", param="prompt")
    p = _prepare(cfg, body, ids, body.logprobs, request_id, tenant, best_of=best_of)
    if not body.echo:
        return p
    if isinstance(prompt, str) and body.truncate_prompt_tokens is None:
        text = prompt
    else:
        text = tok.decode(p.backend_request.token_ids, skip_special_tokens=False)
    return dataclasses.replace(p, echo=text, generate=not echo_only)


MAX_BATCH = 64  # prompts in one completions request


def prepare_completions(
    cfg: GatewayConfig,
    tok: Tokenizer,
    body: CompletionRequest,
    request_id: str,
    tenant: str,
    room: RoomCheck = _no_room_check,
) -> list[Prepared]:
    """`prepare_completion` for each prompt of ``body``: one for a single prompt (a string or
    token ids), one per prompt of a batch (a list of strings or of token-id lists, as OpenAI's
    and vLLM's completions take), request ids ``REQUEST_ID-i``. A bad prompt refuses the whole
    batch, naming its place."""
    prompt = body.prompt
    if not _is_batch(prompt):
        return [prepare_completion(cfg, tok, body, request_id, tenant, room)]
    assert isinstance(prompt, list)
    if len(prompt) == 1:
        one = body.model_copy(update={"prompt": prompt[0]})
        return [prepare_completion(cfg, tok, one, request_id, tenant, room)]
    if len(prompt) > MAX_BATCH:
        raise APIError(
            400, f"prompt: at most {MAX_BATCH} prompts in one request (got {len(prompt)})",
            param="prompt",
        )  # fmt: skip
    out = []
    for i, one_prompt in enumerate(prompt):
        one = body.model_copy(update={"prompt": one_prompt})
        try:
            out.append(prepare_completion(cfg, tok, one, f"{request_id}-{i}", tenant, room))
        except APIError as e:
            if e.status != 400:
                raise
            raise APIError(
                400, f"prompt {i} of the batch: {e.message}", param=e.param, code=e.code
            ) from e
    return out


def _is_batch(prompt: object) -> bool:
    """Whether a completions ``prompt`` is a batch (a list of strings or of token-id lists)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def _best_of(body: CompletionRequest) -> int | None:
    """The number of choices to sample when it exceeds ``n`` (None otherwise)."""
    n = body.n or 1
    if body.best_of is None or body.best_of == n:
        return None
    if not n <= body.best_of <= MAX_N:
        raise APIError(
            400, f"best_of must be in [n, {MAX_N}] (got {body.best_of})", param="best_of"
        )
    if body.stream:
        raise APIError(400, "best_of cannot be used with stream", param="best_of")
    return body.best_of


def _prepare(
    cfg: GatewayConfig,
    body: ChatCompletionRequest | CompletionRequest,
    ids: Sequence[int],
    top_logprobs: int | None,
    request_id: str,
    tenant: str,
    grammar: GrammarSpec | None = None,
    tools: ToolRequest | None = None,
    best_of: int | None = None,
) -> Prepared:
    """Check the prompt against the context, default max_tokens (and what admission books for
    it: `booked_tokens`), build the sampling params."""
    chat = isinstance(body, ChatCompletionRequest)
    prompt_param = "messages" if chat else "prompt"
    max_tokens, max_tokens_param = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, max_tokens_param = body.max_completion_tokens, "max_completion_tokens"
    room = max_tokens if max_tokens is not None and max_tokens > 0 else 1
    ids = truncated(cfg, ids, body.truncate_prompt_tokens, room)
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
    booked = 0  # admission books max_tokens
    if max_tokens is None:
        max_tokens = min(ctx - n, cfg.default_max_tokens)
        # Most answers end long before the cap: book at most --default-booked-tokens (0: all).
        booked = min(max_tokens, cfg.default_booked_tokens)
    choices = best_of or body.n or 1
    # best_of ranks choices by their tokens' logprobs: ask for them even when the client did not.
    logprobs = top_logprobs if best_of is None or top_logprobs is not None else 0
    sampling = _sampling(body, max_tokens, logprobs, choices, grammar, booked)
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
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    kind = "chat" if chat else "completion"
    return Prepared(
        req, kind, bool(body.stream), include_usage, top_logprobs, tools=tools, n=body.n or 1,
        prompt_logprobs=body.prompt_logprobs, continuous_usage=continuous,
        tokens_as_ids=bool(body.return_tokens_as_token_ids),
    )  # fmt: skip


def truncated(
    cfg: GatewayConfig, ids: Sequence[int], keep: int | None, room: int = 1
) -> Sequence[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (None: all; -1: as
    many as the context holds with ``room`` tokens after them, the completion's)."""
    if keep is None:
        return ids
    ctx = cfg.max_model_len
    if keep == -1:
        keep = max(ctx - room, 1)
    if not 1 <= keep <= ctx:
        raise APIError(
            400, f"truncate_prompt_tokens must be -1 or in [1, {ctx}] (the context; got {keep})",
            param="truncate_prompt_tokens",
        )  # fmt: skip
    return ids[-keep:]


def _check_common(cfg: GatewayConfig, body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.model != cfg.served_model_name:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist. This server serves "
            f"`{cfg.served_model_name}`.",
            param="model",
            code="model_not_found",
        )
    if body.n is not None:
        _check_range("n", body.n, 1, MAX_N)
    for name, allowed in NOT_IMPLEMENTED.items():
        if getattr(body, name) not in allowed:
            raise APIError(400, f"{name} is not supported by this server", param=name)
    if body.prompt_logprobs is not None:
        _check_range("prompt_logprobs", body.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        if body.stream:
            raise APIError(
                400, "prompt_logprobs are not available when stream is true",
                param="prompt_logprobs",
            )  # fmt: skip
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    opts = body.stream_options
    if opts is not None and opts.continuous_usage_stats and not opts.include_usage:
        raise APIError(
            400, "stream_options.continuous_usage_stats needs include_usage",
            param="stream_options",
        )  # fmt: skip
    if body.seed is not None:
        _check_range("seed", body.seed, INT64_MIN, INT64_MAX)


def _sampling(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    top_logprobs: int | None,
    n: int,
    grammar: GrammarSpec | None,
    booked_tokens: int = 0,
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
        "min_tokens": body.min_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
    }
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=bool(body.ignore_eos),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=top_logprobs,
            n=n,
            logit_bias=_logit_bias(body.logit_bias),
            grammar=grammar,
            booked_tokens=booked_tokens,
            **kwargs,
        )
    except InvalidRequestError as e:  # messages read "<field>: <why> (got ...)"
        param = str(e).split(":", 1)[0]
        raise APIError(400, str(e), param=param if param.isidentifier() else None) from e


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as pairs (range checks are SamplingParams')."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) > 2**31 - 1:
            raise APIError(
                400, f"logit_bias keys must be token ids (got {key[:40]!r})", param="logit_bias"
            )
        pairs.append((int(key), value))
    return tuple(pairs)


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
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out
