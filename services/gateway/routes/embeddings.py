"""``/v1/embeddings``: pooled as ``engine.pooling`` says (last token, L2-normalised, for a
generative model), computed by prefill workers, metered like a prompt."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.sampling_params import SamplingParams
from services.gateway.core import BackendRequest
from services.gateway.embeddings import embedding_inputs, embedding_response
from services.gateway.http import parse
from services.gateway.schemas import EmbeddingRequest
from services.gateway.state import gateway

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    g = gateway(request)
    body = await parse(request, EmbeddingRequest)
    m = await g.known(body.model)
    inputs = await g.prepare(embedding_inputs, m.config, m.tokenizer, body)
    rid, tenant = request.state.request_id, request.state.tenant
    # Metered like a prompt: the tenant's token budget and the gateway's admission.
    flat = tuple(t for ids in inputs for t in ids)
    metered = BackendRequest(rid, flat, SamplingParams(max_tokens=1), tenant, body.model)
    ticket = g.limits.admit(metered, m.name)
    try:
        vectors, tokens = await g.backend.embed(rid, body.model, inputs)
    except BaseException:
        ticket.settle(0)
        raise
    ticket.settle(0, prompt_only=True)
    answer = embedding_response(body.model, vectors, tokens, body.encoding_format)
    return JSONResponse(answer, headers=ticket.headers)
