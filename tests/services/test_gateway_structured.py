"""The gateway's n > 1, best_of, logit_bias, response_format and tools, as a unit: real uvicorn,
the official openai client, the bundled model's tokenizer and chat template, the scripted
FakeBackend of test_gateway in place of the router."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.tokenizer import Tokenizer
from services.gateway.prepare import prepare_chat
from services.gateway.schemas import ChatCompletionRequest
from services.gateway.tools import tool_support
from tests.services import test_gateway as base
from tests.services.test_gateway import CONFIG, MODEL, REPLY, Gateway, assert_error, chat_body

# The gateway fixtures of test_gateway (one server per module, a fresh FakeBackend per test).
tok, gateway, gw = base.tok, base.gateway, base.gw

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
    "additionalProperties": False,
}


def json_format(schema: object, strict: bool = True, name: str = "person") -> dict:
    spec = {"name": name, "schema": schema, "strict": strict}
    return {"type": "json_schema", "json_schema": spec}


def prompt_text(gw: Gateway, tok: Tokenizer) -> str:
    return tok.decode(gw.fake.requests[-1].token_ids, skip_special_tokens=False)


# --- n, best_of, logit_bias ----------------------------------------------------------------


def test_n_choices_are_indexed_streamed_and_counted(gw: Gateway, tok: Tokenizer) -> None:
    reply_len = len(tok.encode(REPLY))
    out = gw.client.chat.completions.create(model=MODEL, messages=chat_body()["messages"], n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == REPLY and c.finish_reason == "stop" for c in out.choices)
    assert out.usage.completion_tokens == 3 * reply_len
    assert gw.fake.requests[-1].sampling.n == 3
    stream = gw.client.chat.completions.create(
        model=MODEL,
        messages=chat_body()["messages"],
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, roles = ["", "", ""], {}, []
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.index)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 3 * reply_len
    assert roles == [0, 1, 2] and texts == [REPLY] * 3
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}


def test_best_of_keeps_the_most_likely_and_counts_all(gw: Gateway, tok: Tokenizer) -> None:
    out = gw.client.completions.create(model=MODEL, prompt="Hi", best_of=3, n=2)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].logprobs is None
    sent = gw.fake.requests[-1].sampling
    assert sent.n == 3 and sent.logprobs == 0  # logprobs asked for, to rank the choices
    assert out.usage.completion_tokens == 3 * len(tok.encode(REPLY))
    body = {"model": MODEL, "prompt": "Hi", "best_of": 2, "stream": True}
    assert_error(gw.post("/v1/completions", body), 400, "best_of")
    assert_error(gw.post("/v1/completions", {**body, "stream": False, "n": 3}), 400, "best_of")


def test_logit_bias_reaches_the_backend(gw: Gateway) -> None:
    gw.client.chat.completions.create(
        model=MODEL, messages=chat_body()["messages"], logit_bias={"42": -100, "7": 2.5}
    )
    assert gw.fake.requests[-1].sampling.logit_bias == ((7, 2.5), (42, -100.0))
    for bias in ({"x": 1}, {"5": 101}):
        assert_error(gw.post("/v1/chat/completions", chat_body(logit_bias=bias)), 400, "logit_bias")


# --- response_format -------------------------------------------------------------------------


def test_response_formats_become_grammars(gw: Gateway) -> None:
    gw.post("/v1/chat/completions", chat_body(response_format=json_format(PERSON)))
    grammar = gw.fake.requests[-1].sampling.grammar
    assert grammar.kind == "json_schema"
    assert {k: v for k, v in json.loads(grammar.text).items() if k != "x-guidance"} == PERSON
    gw.post("/v1/chat/completions", chat_body(response_format={"type": "json_object"}))
    assert json.loads(gw.fake.requests[-1].sampling.grammar.text)["type"] == "object"
    gw.post("/v1/chat/completions", chat_body(response_format={"type": "text"}))
    assert gw.fake.requests[-1].sampling.grammar is None


@pytest.mark.parametrize(
    "response_format, param, says",
    [
        (json_format({"type": "foo"}), "response_format.json_schema.schema", "not a valid"),
        (json_format({"not": {"type": "string"}}), "response_format.json_schema.schema", "not"),
        (
            json_format({"type": "object", "properties": {"a": {"type": "string"}}}),
            "response_format.json_schema.schema",
            "strict mode",
        ),
        (json_format(PERSON, name="bad name!"), "response_format.json_schema.name", "match"),
        (  # an integer llguidance cannot hold (found by the OpenAPI fuzz): 400, not 500
            json_format({"type": "integer", "minimum": -28203304221100556288}, False),
            "response_format.json_schema.schema",
            "unsupported",
        ),
        ({"type": "json_schema"}, "response_format.json_schema", "needs"),
        ({"type": "xml"}, "response_format.type", None),
    ],
)
def test_bad_response_format_is_400(gw: Gateway, response_format, param, says) -> None:
    err = assert_error(
        gw.post("/v1/chat/completions", chat_body(response_format=response_format)), 400, param
    )
    assert says is None or says in err["message"]
    assert gw.fake.requests == []


def test_non_strict_schema_allows_what_json_schema_allows(gw: Gateway) -> None:
    loose = {"type": "object", "properties": {"a": {"type": "string"}}}
    r = gw.post("/v1/chat/completions", chat_body(response_format=json_format(loose, False)))
    assert r.status_code == 200


# --- tools -----------------------------------------------------------------------------------


def test_tools_reach_the_template_and_a_named_choice_forces_a_call(
    gw: Gateway, tok: Tokenizer
) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    gw.post("/v1/chat/completions", chat_body(tools=[WEATHER], tool_choice=choice))
    prompt = prompt_text(gw, tok)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    grammar = gw.fake.requests[-1].sampling.grammar
    assert grammar.kind == "lark" and grammar.text.startswith("start: call\n")
    assert '"const": "get_weather"' in grammar.text
    gw.post("/v1/chat/completions", chat_body(tools=[WEATHER], tool_choice="required"))
    assert "start: call (" in gw.fake.requests[-1].sampling.grammar.text  # one or more
    gw.post("/v1/chat/completions", chat_body(tools=[WEATHER]))  # auto: no grammar
    assert gw.fake.requests[-1].sampling.grammar is None
    gw.post("/v1/chat/completions", chat_body(tools=[WEATHER], tool_choice="none"))
    assert "<tools>" not in prompt_text(gw, tok)


def test_tokenize_with_tools_counts_the_prompt_a_chat_with_them_runs(gw: Gateway) -> None:
    body = chat_body(tools=[WEATHER])
    counted = gw.post("/tokenize", {"messages": body["messages"], "tools": [WEATHER]}).json()
    gw.post("/v1/chat/completions", body)
    assert counted["tokens"] == list(gw.fake.requests[-1].token_ids)
    r = gw.post("/tokenize", {"prompt": "x", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_tool_calls_in_the_output_are_parsed_and_streamed(gw: Gateway) -> None:
    gw.fake.reply = CALL_TEXT
    messages = chat_body()["messages"]
    out = gw.client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = gw.client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], stream=True
    )
    pieces, finish = [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        pieces += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(pieces) > 2  # the arguments arrive in pieces
    assert {p.index for p in pieces} == {0} and pieces[0].function.name == "get_weather"
    args = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(args) == {"city": "Paris"}


def test_tool_history_is_rendered(gw: Gateway, tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 18}'},
    ]
    r = gw.post("/v1/chat/completions", chat_body(messages=messages, tools=[WEATHER]))
    assert r.status_code == 200, r.text
    prompt = prompt_text(gw, tok)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 18}\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}
                ]
            },  # noqa: E501
            "tools",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tool_requests_are_400(gw: Gateway, extra, param) -> None:
    body = chat_body(**{"tools": [WEATHER], **extra})
    assert_error(gw.post("/v1/chat/completions", body), 400, param)
    assert gw.fake.requests == []


def test_tools_for_a_template_without_tool_support(tmp_path, tok: Tokenizer) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    shutil.copy(f"{CONFIG.model_dir}/tokenizer.json", folder / "tokenizer.json")
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    plain = Tokenizer(folder)
    support = tool_support(plain)
    assert support.parser is None and "does not support tools" in support.why
    body = ChatCompletionRequest.model_validate(chat_body(tools=[WEATHER]))
    with pytest.raises(Exception) as e:
        prepare_chat(CONFIG, plain, body, "chatcmpl-1", "t", support)
    assert e.value.status == 400 and e.value.param == "tools"
    assert tool_support(tok, "none").parser is None  # the flag turns tools off
    assert tool_support(tok).parser == "hermes"


# --- unimplemented OpenAI fields -------------------------------------------------------------


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"prediction": {"type": "content"}}, "prediction"),
        ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        # vLLM's extensions that Tandem does not implement.
        ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("/v1/completions", {"guided_choice": ["a", "b"]}, "guided_choice"),
        ("/v1/chat/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ("/v1/chat/completions", {"cache_salt": "user-7"}, "cache_salt"),
        ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ("/v1/chat/completions", {"echo": True}, "echo"),  # vLLM's chat echo, not completions'
        ("/v1/chat/completions", {"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"add_generation_prompt": False}, "add_generation_prompt"),
        ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ],
)
def test_unimplemented_openai_fields_are_400(gw: Gateway, path, extra, param) -> None:
    base = chat_body() if "chat" in path else {"model": MODEL, "prompt": "Hi"}
    err = assert_error(gw.post(path, {**base, **extra}), 400, param)
    assert "not supported" in err["message"]


def test_fields_that_ask_for_nothing_are_accepted(gw: Gateway) -> None:
    body = chat_body(store=False, modalities=["text"], service_tier="auto", metadata=None)
    assert gw.post("/v1/chat/completions", body).status_code == 200
    vllm = chat_body(min_tokens=0, skip_special_tokens=True, use_beam_search=False,
                     include_stop_str_in_output=False, bad_words=[], echo=False,
                     add_generation_prompt=True, chat_template_kwargs={})  # fmt: skip
    assert gw.post("/v1/chat/completions", vllm).status_code == 200


def test_tool_flags_and_their_environment_variables(tmp_path, tok: Tokenizer) -> None:
    from services.gateway.__main__ import parse_config

    base = ["--model-dir", CONFIG.model_dir, "--router", "x:1"]
    assert parse_config(base, env={}).tool_call_parser == "auto"
    env = {"TANDEM_TOOL_CALL_PARSER": "llama3_json", "TANDEM_TOOL_CHAT_TEMPLATE": "t.jinja"}
    cfg = parse_config(base, env=env)
    assert (cfg.tool_call_parser, cfg.tool_chat_template) == ("llama3_json", "t.jinja")
    assert parse_config([*base, "--tool-call-parser", "none"], env=env).tool_call_parser == "none"
    with pytest.raises(SystemExit):
        parse_config([*base, "--tool-call-parser", "xml"], env={})
    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}")
    support = tool_support(tok, "llama3_json", str(template))
    assert support.parser == "llama3_json" and support.template is not None
