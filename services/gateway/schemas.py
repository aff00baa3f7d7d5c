"""OpenAI request bodies of the gateway, as strict pydantic models.

Strict means JSON types must match (``"5"`` is not an integer, ``1`` is not a boolean); a
JSON integer is still accepted where a number is expected. Fields no OpenAI API defines are
ignored. OpenAI fields Tandem does not implement, and vLLM's extensions it does not, are parsed
loosely (``NOT_IMPLEMENTED``) so that ``prepare`` can refuse them with a 400 naming the field
instead of ignoring them.
Semantic checks (ranges, limits, the model name, schemas) happen in ``prepare``, where the
tokenizer and the config are at hand.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI request fields Tandem does not implement, with the values that ask for nothing (a
# client may send those); any other value gets a 400 naming the field.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "functions": (None,),
    "function_call": (None,),
    "store": (None, False),
    "metadata": (None,),
    "service_tier": (None, "auto", "default"),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "suffix": (None, ""),
    # vLLM's extensions that Tandem does not implement: refused the same way, so that a client
    # written for vLLM learns at once instead of getting output that ignored them.
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    # Prefix caches are isolated per tenant (API key) already; a finer salt is not carried.
    "cache_salt": (None,),
    "structured_outputs": (None,),
    "logits_processors": (None,),
}


# vLLM's extensions of chat requests that Tandem does not implement, refused as NOT_IMPLEMENTED.
CHAT_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "add_special_tokens": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Body):
    """One part of a message's content; only ``type == "text"`` is supported."""

    type: str
    text: str | None = None


class FunctionCall(_Body):
    """The function an assistant message called: ``arguments`` is a JSON text."""

    name: str
    arguments: str


class ToolCall(_Body):
    """One call in an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """A chat message. ``content`` is a string, a list of text parts, or null (assistant).
    Assistant messages may carry ``tool_calls``; ``tool`` messages answer one by
    ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    """A callable function: ``parameters`` is a JSON Schema of its arguments object."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    """An entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: ``schema`` is the JSON Schema the output must match."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with usage and no choices."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage so far in every chunk


class _Sampling(_Body):
    """Fields shared by chat and text completions (OpenAI names, plus vLLM's extensions)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions (vLLM names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # the logprobs of the prompt's own tokens, top k
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context)
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:ID"
    # Tandem extensions: scheduling class (batch is shed first under load) and a deadline in
    # seconds for the whole request (capped by the server's --max-request-timeout).
    priority: Literal["interactive", "batch"] | None = None
    timeout: float | None = None
    # Latency objectives of this request in ms (`services.gateway.slo`; OpenAI clients send them
    # in extra_body): where the router computes the prompt, and the request's goodput.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # OpenAI fields Tandem does not implement (see NOT_IMPLEMENTED); loosely typed on purpose.
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    functions: Any = None
    function_call: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    suffix: Any = None
    # vLLM extensions Tandem does not implement (NOT_IMPLEMENTED).
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    cache_salt: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None


class ChatCompletionRequest(_Sampling):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions Tandem does not implement (CHAT_NOT_IMPLEMENTED).
    echo: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    add_special_tokens: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None


class CompletionRequest(_Sampling):
    """Body of ``POST /v1/completions``. ``prompt``: a string or a list of token ids, or a
    batch of them (a list of strings, a list of token-id lists)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own (a BOS) before a text prompt


class LoadLoraAdapterRequest(_Body):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and unused:
    adapters are named)."""

    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize`` body: a completions ``prompt`` or chat ``messages`` (with
    ``tools``), tokenized as those requests would be."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # vLLM's fields Tandem does not implement, refused as NOT_IMPLEMENTED.
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize`` body."""

    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Body):
    """OpenAI's ``POST /v1/embeddings`` body: ``input`` is a string, a list of strings, a list of
    token ids or a list of token-id lists."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own (a BOS) before a text input
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's last k tokens
