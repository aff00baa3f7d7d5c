"""``Embed`` and ``PromptLogprobs`` of both worker roles: each input is one prefill outside the
continuous batch (``LLMEngine.embed``, ``LLMEngine.prompt_logprobs``), run by the engine between
two steps, admitted in tokens like a prompt."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from tandem.v1 import common_pb2

from engine.errors import InvalidRequestError
from engine.sampling_params import TokenLogprob
from services.common.codec import logprob_to_pb

if TYPE_CHECKING:
    from engine.core.client import EngineClient
    from services.common.admission import TokenLedger

T = TypeVar("T")


async def embed(
    engine: EngineClient, ledger: TokenLedger, request: common_pb2.EmbedRequest
) -> common_pb2.EmbedResponse:
    def run(ids: list[int]) -> Awaitable[list[float]]:
        return engine.embed(ids, request.model or None)

    vectors, tokens = await _each_prompt(ledger, request, "embed", run)
    out = common_pb2.EmbedResponse(prompt_tokens=tokens)
    for v in vectors:
        out.embeddings.add(values=v)
    return out


async def prompt_logprobs(
    engine: EngineClient, ledger: TokenLedger, request: common_pb2.PromptLogprobsRequest
) -> common_pb2.PromptLogprobsResponse:
    def run(ids: list[int]) -> Awaitable[list[TokenLogprob]]:  # the engine checks top_logprobs
        return engine.prompt_logprobs(ids, request.top_logprobs, request.model or None)

    scored, tokens = await _each_prompt(ledger, request, "score", run)
    out = common_pb2.PromptLogprobsResponse(prompt_tokens=tokens)
    for lps in scored:
        out.prompts.add(tokens=[logprob_to_pb(lp) for lp in lps])
    return out


async def _each_prompt(
    ledger: TokenLedger,
    request: common_pb2.EmbedRequest | common_pb2.PromptLogprobsRequest,
    what: str,
    run: Callable[[list[int]], Awaitable[T]],
) -> tuple[list[T], int]:
    """``run(ids)`` for each input in turn (the engine runs each between two steps), with the
    inputs' tokens held in the worker's admission ledger meanwhile; (results, tokens)."""
    inputs = [list(i.token_ids) for i in request.inputs]
    if not inputs:
        raise InvalidRequestError(f"nothing to {what}: inputs is empty")
    tokens = sum(len(ids) for ids in inputs)
    with ledger.hold(f"{what}-{request.request_id or uuid.uuid4().hex}", tokens):
        return [await run(ids) for ids in inputs], tokens
