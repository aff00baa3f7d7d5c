"""End to end, structured output, tool calling and n > 1: real etcd and the services as
processes on loopback (one prefill, two decode workers), the bundled SmolLM2-135M-Instruct, the
official ``openai`` client. Unconstrained, a 135M model writes invalid JSON, so only a working
grammar passes these; long prompts go prefill -> KV hand-off -> decode, short ones decode-only,
so the grammar state is replayed across the hand-off."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import jsonschema
import openai
import pytest

from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack.test_e2e_stack import MODEL, assert_all_free
from tests.stack_probe import worker_stats

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_ARGS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
            },
        },
    },
]
# Over the 256-token decode-only threshold: these go through the prefill worker, unless a
# decode worker already caches them (so each long prompt starts with a tag of its own).
CONTEXT = " ".join(f"Record {i}: a person was seen at gate {i % 7}." for i in range(40))


def ask(long: bool, tag: object = "") -> list[dict]:
    content = "Describe a person as JSON with name, age and hobbies."
    if long:
        content = f"[{tag}] {CONTEXT}\n\n{content}"
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory):
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path_factory.mktemp("structured")),
        port=free_port(),
        num_prefill=1,
        num_decode=2,
        member_ttl=3,
        member_refresh=1.0,
        # The n > 1 test is about where a long prompt is computed (once, on the prefill
        # worker): the length rule, not the load-dependent SLO-aware choice.
        disagg_mode="length",
    )
    with Stack(config) as s:
        yield s
        for name in s.children:
            log = s.children[name].log_path.read_text(errors="replace")
            assert "left its grammar" not in log, name


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def person_samples(client: openai.OpenAI, long: bool, stream: bool, seed: int) -> list[str]:
    """Four samples (n=4) at temperature 1.0, as texts."""
    kw = dict(
        model=MODEL,
        messages=ask(long, seed),
        n=4,
        temperature=1.0,
        max_tokens=200,
        seed=seed,
        response_format=PERSON_FORMAT,
    )
    if not stream:
        out = client.chat.completions.create(**kw)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert all(c.finish_reason == "stop" for c in out.choices)
        return [c.message.content for c in out.choices]
    texts = [""] * 4
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    return texts


# The long sampled runs (20 samples of up to 200 tokens each) and the kill: `make test-stack`.
@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_json_schema_samples_at_temperature_one_all_validate(stack, client, stream):
    jobs = [(i % 2 == 1, 1000 * i + int(stream)) for i in range(5)]  # 5 x n=4 = 20 samples
    prefilled = worker_stats(stack)["prefill-0"].prompt_tokens
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        texts = [
            t for ts in pool.map(lambda j: person_samples(client, j[0], stream, j[1]), jobs)
            for t in ts
        ]  # fmt: skip
    assert len(texts) == 20
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    # The two long prompts went through the prefill worker (grammar replayed on decode).
    assert worker_stats(stack)["prefill-0"].prompt_tokens - prefilled > 2 * 256
    assert_all_free(stack)


@pytest.mark.stack
def test_forced_tool_calls_validate(client):
    """Named and required choices force a call at temperature 1.0. (With parallel calls
    allowed, ``required`` lets a sampled model go on calling until max_tokens: one call.)"""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for long, choice in ((False, named), (True, named), (False, "required")):
        context = f"[{len(str(choice))}] {CONTEXT}" if long else ""
        messages = [{"role": "user", "content": context + " Weather in Oslo?"}]
        out = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, temperature=1.0,
            max_tokens=200, n=2, parallel_tool_calls=False,
        )  # fmt: skip
        for c in out.choices:
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
            for call in c.message.tool_calls:
                args = json.loads(call.function.arguments)
                if choice == named:
                    assert call.function.name == "get_weather"
                if call.function.name == "get_weather":
                    jsonschema.validate(args, WEATHER_ARGS)
                assert call.id.startswith("call_") and call.type == "function"


def test_streamed_tool_call_deltas_assemble(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Lima?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(pieces) > 2
    assert {p.index for p in pieces} == {0}
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert all(p.id is None for p in pieces[1:])
    jsonschema.validate(json.loads("".join(p.function.arguments for p in pieces)), WEATHER_ARGS)


def test_tool_result_turn_renders_and_answers(client):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_0",
            "content": '{"temperature": 18, "sky": "clear"}',
        },
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=40,
        temperature=0,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    # The prompt holds the tool definitions' template, the call and the result.
    plain = client.chat.completions.create(
        model=MODEL, messages=messages[:1], max_tokens=1, temperature=0
    )
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 30


@pytest.mark.parametrize("long", [False, True], ids=["decode-only", "disaggregated"])
def test_n_choices_share_one_prompt(stack, client, long):
    before = worker_stats(stack)["prefill-0"].prompt_tokens
    prompt = (CONTEXT if long else "") + f" Tell me a story number {int(long)}."
    kw = dict(model=MODEL, prompt=prompt, n=4, max_tokens=12, temperature=1.0, seed=7)
    out = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 4 * 12  # usage counts every choice
    prefilled = worker_stats(stack)["prefill-0"].prompt_tokens - before
    assert prefilled == (out.usage.prompt_tokens if long else 0)  # the prompt computed once
    again = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seed reproduces
    streamed = client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
    texts = [""] * 4
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in out.choices]
    assert_all_free(stack)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "foo"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "not": {"type": "string"}}}}}, "response_format.json_schema.schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
         "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"logit_bias": {"99999999": 1}}, None),
    ],
)  # fmt: skip
def test_bad_inputs_are_400(stack, extra, param):
    body = {"model": MODEL, "messages": ask(False), "max_tokens": 4, **extra}
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert param is None or r.json()["error"]["param"] == param


def test_aborted_request_mid_grammar_frees_its_blocks(stack):
    body = {
        "model": MODEL,
        "messages": ask(True, "abort"),
        "max_tokens": 300,
        "n": 2,
        "stream": True,
        "response_format": {"type": "json_object"},
    }
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", stack.url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: {")
            if seen == 8:
                assert sum(s.kv_blocks_used for s in worker_stats(stack).values()) > 0
                break  # the client leaves mid-grammar
    assert_all_free(stack, within=2.0)


@pytest.mark.stack
def test_grammar_survives_a_move_to_another_decode_worker(stack, client):
    """Killed decode-0 stays in the routers' view until its lease lapses, and wins ties: the
    router's booking of decode capacity on it fails before any prefill, and the request goes to
    decode-1 (or, had decode-0 died after the booking, moves there with its first tokens, whose
    matchers replay them); the output still follows the schema."""
    # Let decode-0 publish its idle load first: a report from the previous test (streams still
    # running) would otherwise stay in the routers' view after the kill and make it lose ties.
    time.sleep(stack.config.member_refresh + 0.5)
    stack.kill("decode-0")
    router_log = stack.children["router"].log_path
    deadline = time.monotonic() + stack.config.member_ttl + 2
    done = 0
    try:
        while time.monotonic() < deadline or done < 2:
            messages = ask(True, f"move {done}")
            out = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=200, temperature=1.0,
                response_format=PERSON_FORMAT,
            )  # fmt: skip
            jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
            done += 1
        text = router_log.read_text()
        assert "decoding on decode-1 instead" in text or "retrying on another worker" in text
    finally:
        stack.restart("decode-0")
