"""Tool calling: which format the model writes calls in, which template shows it the tools,
and the grammar that forces a call (``tool_choice`` ``required`` or a named function).

The format is chosen by model (``--tool-call-parser auto``): a template that writes
``<tool_call>`` or any ChatML template (``<|im_start|>``: Qwen2.5, SmolLM2) means Hermes-style
calls; one that knows ``<|python_tag|>`` or the ``ipython`` role means Llama 3.1 JSON calls. A
model whose own template renders ``tools`` gets them through it; a ChatML model whose template
does not (SmolLM2's) gets the Hermes ChatML template below for requests that carry tools or
tool messages, and keeps its own template otherwise. ``--tool-chat-template FILE`` replaces
the tool template; ``--tool-call-parser none`` turns tools off (400).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Template

from engine.grammar import JSON_OPTIONS, GrammarSpec
from engine.tokenizer import Tokenizer
from services.gateway.core import APIError
from services.gateway.schemas import NamedToolChoice, Tool
from services.gateway.structured import check_name, check_schema
from services.gateway.tool_parser import PARSERS

TOOL_CALL_PARSER_CHOICES = ("auto", "none", *PARSERS)

# Hermes-style tool calling in ChatML, after Qwen2.5's template.
HERMES_CHATML = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}\
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) \
or (message.role == 'assistant' and not message.get('tool_calls')) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}\
{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}\
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@dataclass(frozen=True, slots=True)
class ToolSupport:
    """How this gateway's model calls tools: ``parser`` (None: tools refused, ``why``) and the
    template for requests with tools (None: the model's own)."""

    parser: str | None
    template: Template | None = None
    why: str = ""


def detect_parser(template: str | None) -> str | None:
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes" if "<|im_start|>" in template else None


def tool_support(tok: Tokenizer, parser: str = "auto", template_file: str = "") -> ToolSupport:
    """Resolve the format and template once, at start (flags ``--tool-call-parser`` and
    ``--tool-chat-template``)."""
    if parser not in TOOL_CALL_PARSER_CHOICES:
        raise ValueError(f"--tool-call-parser must be one of {TOOL_CALL_PARSER_CHOICES}")
    fmt = detect_parser(tok.chat_template) if parser == "auto" else parser
    if fmt is None or fmt == "none":
        why = "tools are turned off" if parser == "none" else "its chat template has no tool format"
        return ToolSupport(None, why=f"this model does not support tools: {why}")
    if template_file:
        return ToolSupport(fmt, tok.compile_template(Path(template_file).read_text()))
    if tok.supports_tools:
        return ToolSupport(fmt)
    if fmt == "hermes" and "<|im_start|>" in (tok.chat_template or ""):
        return ToolSupport(fmt, tok.compile_template(HERMES_CHATML))
    return ToolSupport(
        None, why="this model does not support tools: its chat template does not render them"
    )


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tools of one chat request: what the template gets and how output is read."""

    parser: str  # tool-call format of the output
    tools: list[dict[str, Any]]  # passed to the template (OpenAI form); empty with "none"
    grammar: GrammarSpec | None  # forces a call (required / named)
    parse: bool  # read tool calls out of the output


def tool_request(
    support: ToolSupport,
    tools: list[Tool] | None,
    choice: str | NamedToolChoice | None,
    parallel: bool | None,
) -> ToolRequest | None:
    """Validate ``tools`` and ``tool_choice``; None when the request uses no tools."""
    if not tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if support.parser is None:
        raise APIError(400, support.why, param="tools")
    names = _check_tools(tools)
    choice = choice or "auto"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(
            400,
            f"tool_choice names {choice.function.name[:80]!r}, which is not in tools "
            f"({', '.join(sorted(names))[:200]})",
            param="tool_choice",
        )
    if choice == "none":
        return ToolRequest(support.parser, [], None, False)
    forced = None
    if choice == "required":
        forced = tools
    elif isinstance(choice, NamedToolChoice):
        forced = [t for t in tools if t.function.name == choice.function.name]
    one = parallel is False or isinstance(choice, NamedToolChoice)
    grammar = call_grammar(support.parser, forced, one) if forced else None
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    return ToolRequest(support.parser, dumped, grammar, True)


def _check_tools(tools: list[Tool]) -> set[str]:
    names: set[str] = set()
    for i, t in enumerate(tools):
        fn = t.function
        check_name(fn.name, f"tools[{i}].function.name")
        if fn.name in names:
            raise APIError(400, f"tool {fn.name!r} is defined twice", param=f"tools[{i}]")
        names.add(fn.name)
        if fn.parameters is not None:
            check_schema(fn.parameters, f"tools[{i}].function.parameters", bool(fn.strict))
    return names


def call_grammar(fmt: str, tools: list[Tool], one: bool) -> GrammarSpec:
    """A Lark grammar whose sentences are valid calls of ``tools`` (exactly one with ``one``)."""
    key = "arguments" if fmt == "hermes" else "parameters"
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                key: t.function.parameters or {"type": "object", "properties": {}},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = json.dumps({"anyOf": options, "x-guidance": JSON_OPTIONS})
    if fmt == "hermes":
        call, sep = f'"<tool_call>\\n" %json {schema} "\\n</tool_call>"', '"\\n"'
    else:
        call, sep = f"%json {schema}", '"; "'
    start = "start: call" if one else f"start: call ({sep} call)*"
    return GrammarSpec("lark", f"{start}\ncall: {call}\n")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments as objects, the way tool templates render them (``| tojson``)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [_with_parsed_arguments(c) for c in m["tool_calls"]]}
        out.append(m)
    return out


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**call["function"], "arguments": args}}
