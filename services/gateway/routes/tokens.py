"""vLLM's ``/tokenize`` (the ids of a completions prompt or of chat messages, as a request runs
them) and ``/detokenize`` (the text of token ids)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.http import parse
from services.gateway.schemas import DetokenizeRequest, TokenizeRequest
from services.gateway.state import gateway
from services.gateway.tokenize import detokenize as detokenize_ids
from services.gateway.tokenize import tokenize as tokenize_ids

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    g = gateway(request)
    body = await parse(request, TokenizeRequest)
    m = await g.known(body.model) if body.model is not None else g.served[0]
    args = (m.config, m.tokenizer, m.tools, m.text_of, body)
    return JSONResponse(await g.prepare(tokenize_ids, *args))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    g = gateway(request)
    body = await parse(request, DetokenizeRequest)
    m = await g.known(body.model) if body.model is not None else g.served[0]
    return JSONResponse(await g.prepare(detokenize_ids, m.tokenizer, body))
