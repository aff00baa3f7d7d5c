"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the ids the gateway's tokenizer makes
of a completions prompt or of chat messages (what a request with the same input runs, so a
client can count its tokens against ``max_model_len``), and the text of ids."""

from __future__ import annotations

from typing import Any

from engine.tokenizer import Tokenizer
from services.gateway.config import GatewayConfig
from services.gateway.core import APIError
from services.gateway.prepare import chat_ids
from services.gateway.responses import TokenText
from services.gateway.schemas import DetokenizeRequest, TokenizeRequest
from services.gateway.tools import ToolSupport, tool_request

NOT_IMPLEMENTED = {"continue_final_message": (None, False), "chat_template": (None,),
                   "chat_template_kwargs": (None, {})}  # fmt: skip


def tokenize(
    cfg: GatewayConfig,
    tok: Tokenizer,
    tools: ToolSupport,
    text_of: TokenText,
    body: TokenizeRequest,
) -> dict[str, Any]:
    """``{count, max_model_len, tokens, token_strs}`` (``token_strs``: each id's text, when
    ``return_token_strs``; else null)."""
    for name, allowed in NOT_IMPLEMENTED.items():
        if getattr(body, name) not in allowed:
            raise APIError(400, f"{name} is not supported by this server", param=name)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.messages is not None:
        if body.add_special_tokens:
            raise APIError(
                400, "add_special_tokens with messages is not supported: the chat template "
                "writes the special tokens", param="add_special_tokens",
            )  # fmt: skip
        req_tools = tool_request(tools, body.tools, None, None)
        ids = chat_ids(tok, body.messages, tools, req_tools, body.add_generation_prompt)
    else:
        if body.tools is not None:
            raise APIError(400, "tools go with messages, not a prompt", param="tools")
        assert body.prompt is not None
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tok.encode_prompt(body.prompt, special)
    return {
        "count": len(ids),
        "max_model_len": cfg.max_model_len,
        "tokens": ids,
        "token_strs": [text_of(t) for t in ids] if body.return_token_strs else None,
    }


def detokenize(tok: Tokenizer, body: DetokenizeRequest) -> dict[str, Any]:
    """``{prompt}``: the text of the ids (special tokens kept, as in a prompt)."""
    vocab = tok.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: token id {bad} is not in [0, {vocab})", param="tokens")
    return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
