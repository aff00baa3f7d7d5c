"""Grammars for constrained decoding: what a request asks for, and checking it (no torch).

A ``GrammarSpec`` travels with a request's sampling parameters from the gateway to every worker
that samples for it. Workers turn it into an llguidance matcher (``engine.structured``) that
says, before each token, which tokens keep the output a prefix of the grammar's language.

JSON is generated compactly: no free whitespace, ``", "`` between items and ``": "`` after keys
(the separators of ``json.dumps``). Free whitespace lets a small model at high temperature pad
its output with newlines until ``max_tokens`` runs out; fixed separators never change what a
document means. A schema may override this with llguidance's own ``"x-guidance"`` options.

Object properties are generated in the order the schema lists them (llguidance's rule), which
also makes a tool call's ``"name"`` come before its ``"arguments"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError

GRAMMAR_KINDS = ("json_schema", "lark", "regex")
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_GRAMMAR_CHARS = 256 * 1024


class InvalidGrammarError(InvalidRequestError):
    """A grammar or JSON schema that is malformed or uses what the matcher does not support."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on a request's output.

    ``kind`` is ``"json_schema"`` (``text`` is a JSON Schema document), ``"lark"`` (an
    llguidance Lark grammar, which may embed ``%json {schema}``) or ``"regex"``.
    """

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidGrammarError(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)} (got {self.kind!r})"
            )
        if not isinstance(self.text, str) or not self.text:
            raise InvalidGrammarError("grammar text must be a non-empty string")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidGrammarError(f"grammar text is over {MAX_GRAMMAR_CHARS} characters")

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GrammarSpec:
        """A spec for ``schema`` (a parsed JSON Schema), with Tandem's JSON layout."""
        return cls("json_schema", json.dumps(with_json_options(schema), separators=(",", ":")))


def with_json_options(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the compact JSON layout (``JSON_OPTIONS``) unless it sets its own."""
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": JSON_OPTIONS}


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec`` (InvalidGrammarError for JSON that does not parse)."""
    import llguidance  # a Rust extension without torch: cheap for the gateway too

    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except ValueError as e:
            raise InvalidGrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise InvalidGrammarError("a JSON schema must be an object or a boolean")
        if isinstance(schema, dict):
            schema = with_json_options(schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:  # what it cannot take in, e.g. an integer past 64 bits
            raise InvalidGrammarError(f"unsupported JSON schema: {e}") from e
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    return llguidance.LLMatcher.grammar_from_regex(spec.text)


def check_grammar(spec: GrammarSpec) -> None:
    """Raise InvalidGrammarError, with the matcher's reason, unless ``spec`` compiles."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(llguidance_grammar(spec))
    if error:
        raise InvalidGrammarError(f"unsupported or invalid {spec.kind} grammar: {error}")
