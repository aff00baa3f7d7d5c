"""``Embed`` and ``PromptLogprobs`` of both worker roles: each input is one prefill outside the
continuous batch (``LLMEngine.embed``, ``LLMEngine.prompt_logprobs``), run between steps in a
worker thread, admitted in tokens like a prompt."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from tandem.v1 import common_pb2

from engine.errors import InvalidRequestError
from engine.sampling_params import TokenLogprob
from services.common.codec import logprob_to_pb

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from services.common.admission import TokenLedger

T = TypeVar("T")


async def embed(
    engine: AsyncEngine, ledger: TokenLedger, request: common_pb2.EmbedRequest
) -> common_pb2.EmbedResponse:
    def run(ids: list[int]) -> list[float]:
        return engine.engine.embed(ids, request.model or None).tolist()

    vectors, tokens = await _each_prompt(engine, ledger, request, "embed", run)
    out = common_pb2.EmbedResponse(prompt_tokens=tokens)
    for v in vectors:
        out.embeddings.add(values=v)
    return out


async def prompt_logprobs(
    engine: AsyncEngine, ledger: TokenLedger, request: common_pb2.PromptLogprobsRequest
) -> common_pb2.PromptLogprobsResponse:
    def run(ids: list[int]) -> list[TokenLogprob]:  # top_logprobs is checked by the engine
        return engine.engine.prompt_logprobs(ids, request.top_logprobs, request.model or None)

    scored, tokens = await _each_prompt(engine, ledger, request, "score", run)
    out = common_pb2.PromptLogprobsResponse(prompt_tokens=tokens)
    for lps in scored:
        out.prompts.add(tokens=[logprob_to_pb(lp) for lp in lps])
    return out


async def _each_prompt(
    engine: AsyncEngine,
    ledger: TokenLedger,
    request: common_pb2.EmbedRequest | common_pb2.PromptLogprobsRequest,
    what: str,
    run: Callable[[list[int]], T],
) -> tuple[list[T], int]:
    """``run(ids)`` for each input in turn, in the engine's thread between steps, with the
    inputs' tokens held in the worker's admission ledger meanwhile; (results, tokens)."""
    inputs = [list(i.token_ids) for i in request.inputs]
    if not inputs:
        raise InvalidRequestError(f"nothing to {what}: inputs is empty")
    tokens = sum(len(ids) for ids in inputs)
    with ledger.hold(f"{what}-{request.request_id or uuid.uuid4().hex}", tokens):
        return [await engine.run(run, ids) for ids in inputs], tokens
