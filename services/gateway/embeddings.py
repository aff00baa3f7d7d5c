"""``POST /v1/embeddings`` (OpenAI's schema): tokenize and check the inputs, answer in float or
base64 (little-endian float32, as OpenAI's clients decode it) with usage. Prefill workers do the
work (`services.worker.embed`); pooling is the model's (`engine.pooling`)."""

from __future__ import annotations

import base64
import struct
from typing import Any

from engine.tokenizer import Tokenizer
from services.gateway.config import GatewayConfig
from services.gateway.core import APIError
from services.gateway.prepare import truncated
from services.gateway.schemas import EmbeddingRequest

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


def embedding_inputs(cfg: GatewayConfig, tok: Tokenizer, body: EmbeddingRequest) -> list[list[int]]:
    """The token ids of every input (text tokenized without special tokens, as completions)."""
    if body.dimensions is not None:
        raise APIError(
            400, "dimensions is not supported: embeddings have the model's hidden size",
            param="dimensions",
        )  # fmt: skip
    raw = body.input
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [list(raw)]  # type: ignore[arg-type]
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(items)} items; at most {MAX_INPUTS}", param="input")
    special, keep = body.add_special_tokens, body.truncate_prompt_tokens
    out = [
        list(truncated(cfg, tok.encode_prompt(x, special) if isinstance(x, str) else x, keep))
        for x in items
    ]
    vocab, limit = tok.vocab_size, cfg.max_model_len
    for i, ids in enumerate(out):
        if not ids:
            raise APIError(400, f"input[{i}] is empty", param="input")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"input[{i}]: token id {bad} is not in [0, {vocab})", param="input")
        if limit and len(ids) >= limit:
            raise APIError(
                400, f"input[{i}] has {len(ids)} tokens; this model's context is {limit} tokens",
                param="input",
            )  # fmt: skip
    return out


def embedding_response(
    model: str, vectors: list[list[float]], prompt_tokens: int, encoding_format: str
) -> dict[str, Any]:
    def encode(v: list[float]) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")
        return v

    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode(v)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
