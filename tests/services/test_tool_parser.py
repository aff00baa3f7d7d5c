"""Tool calls read out of generated text: Hermes and Llama 3.1 JSON formats, fed whole or in
pieces of every size, give the same content and calls."""

from __future__ import annotations

import json

import pytest

from services.gateway.tool_parser import Parsed, ToolCallParser, merge

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } \\" {"}}'


def run(fmt: str, text: str, piece: int) -> tuple[str, list[dict], list[Parsed]]:
    parser = ToolCallParser(fmt)
    parts = [parser.feed(text[i : i + piece]) for i in range(0, len(text), piece)]
    parts.append(parser.finish())
    content, calls = merge(parts)
    return content, calls, parts


def args_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_hermes_calls_with_text_around_them(piece: int) -> None:
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + (
        '{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls, parts = run("hermes", text, piece)
    assert content == "Let me check."
    assert args_of(calls) == [
        ("get_weather", {"city": "Paris", "note": 'a } " {'}),
        ("get_time", {}),
    ]
    assert [c["type"] for c in calls] == ["function", "function"]
    assert len({c["id"] for c in calls}) == 2 and calls[0]["id"].startswith("call_")
    # The id and name come once, in the first piece of each call; arguments are streamed.
    starts = [d for p in parts for d in p.calls if d.id is not None]
    assert [d.name for d in starts] == ["get_weather", "get_time"]
    if piece == 1:
        assert sum(1 for p in parts for d in p.calls if d.index == 0) > 10


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_hermes_plain_text_and_partial_tags(piece: int) -> None:
    content, calls, _ = run("hermes", "  a <tool but not a call; x < y  \n", piece)
    assert content == "a <tool but not a call; x < y" and calls == []


def test_hermes_other_shapes_are_read_whole_or_left_as_text() -> None:
    # SmolLM2 writes a list of calls in one block; arguments before name are also accepted.
    text = (
        '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
        '</tool_call><tool_call>{"arguments": {"y": 2}, "name": "c"}</tool_call>'
    )
    _, calls, _ = run("hermes", text, 5)
    assert args_of(calls) == [("a", {"x": 1}), ("b", {}), ("c", {"y": 2})]
    content, calls, _ = run("hermes", "<tool_call>not json</tool_call>", 3)
    assert calls == [] and content == "<tool_call>not json"


def test_hermes_unfinished_call_at_the_end() -> None:
    _, calls, _ = run("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', 4)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": [1, 2'}


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_llama3_json_calls_and_plain_text(piece: int) -> None:
    text = '{"name": "f", "parameters": {"q": "x;y"}}; {"name": "g", "parameters": {}}'
    content, calls, _ = run("llama3_json", text, piece)
    assert content == "" and args_of(calls) == [("f", {"q": "x;y"}), ("g", {})]
    content, calls, _ = run("llama3_json", "  The answer is {42}.", piece)
    assert content == "The answer is {42}." and calls == []


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError):
        ToolCallParser("xml")
