"""``Embed`` of both worker roles: each input is one prefill outside the continuous batch
(``LLMEngine.embed``), run between steps in a worker thread, admitted in tokens like a prompt."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from tandem.v1 import common_pb2

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from services.common.admission import TokenLedger


async def embed(
    engine: AsyncEngine, ledger: TokenLedger, request: common_pb2.EmbedRequest
) -> common_pb2.EmbedResponse:
    inputs = [list(i.token_ids) for i in request.inputs]
    if not inputs:
        raise InvalidRequestError("nothing to embed: inputs is empty")
    tokens = sum(len(ids) for ids in inputs)
    out = common_pb2.EmbedResponse(prompt_tokens=tokens)
    with ledger.hold(f"embed-{request.request_id or uuid.uuid4().hex}", tokens):
        for ids in inputs:
            vector = await engine.run(engine.engine.embed, ids, request.model or None)
            out.embeddings.add(values=vector.tolist())
    return out
