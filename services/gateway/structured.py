"""``response_format`` and JSON Schemas of requests: checked here, enforced by a grammar.

A schema gets a 400 naming the field when it is not a valid JSON Schema (``jsonschema``'s
meta-schema check), when it uses what the grammar compiler does not support (llguidance says
which keywords), or, under ``strict: true``, when it breaks OpenAI's strict-mode rules: every
object lists all its properties in ``required`` and sets ``additionalProperties: false``.
Honouring ``strict`` this way means a schema OpenAI accepts in strict mode is accepted and
enforced exactly, and one it refuses is refused. Without ``strict`` the schema is enforced as
JSON Schema reads it (extra properties allowed unless it says otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from jsonschema import Draft202012Validator, SchemaError, validators

from engine.grammar import GrammarSpec, InvalidGrammarError, check_grammar
from services.gateway.core import APIError
from services.gateway.schemas import ResponseFormat

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def response_format_grammar(rf: ResponseFormat | None) -> GrammarSpec | None:
    """The grammar that enforces ``response_format`` (None for text)."""
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise APIError(400, "json_schema needs type 'json_schema'", param="response_format")
        return None
    if rf.type == "json_object":
        return GrammarSpec.json_schema({"type": "object"})
    spec = rf.json_schema
    if spec is None:
        raise APIError(
            400,
            "response_format of type 'json_schema' needs a 'json_schema' object",
            param="response_format.json_schema",
        )
    check_name(spec.name, "response_format.json_schema.name")
    schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
    param = "response_format.json_schema.schema"
    check_schema(schema, param, strict=bool(spec.strict))
    return GrammarSpec.json_schema(schema)


def check_name(name: str, param: str) -> None:
    if not NAME.match(name):
        raise APIError(
            400, f"{param} must match ^[A-Za-z0-9_-]{{1,64}}$ (got {name[:80]!r})", param=param
        )


def check_schema(schema: Any, param: str, strict: bool) -> None:
    """400 (naming ``param``) unless ``schema`` is a valid, supported JSON Schema."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON object", param=param)
    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise APIError(
            400, f"{param} is not a valid JSON Schema{' at ' + where if where else ''}: "
            f"{e.message[:200]}", param=param
        ) from e  # fmt: skip
    if strict:
        problem = next(_strict_problems(schema, "#"), None)
        if problem is not None:
            raise APIError(400, f"{param}: strict mode: {problem}", param=param)
    try:
        check_grammar(GrammarSpec.json_schema(schema))
    except InvalidGrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param) from e


def _strict_problems(schema: Any, path: str) -> Iterator[str]:
    """OpenAI strict-mode violations in ``schema``, as 'where: what' strings."""
    if not isinstance(schema, dict):
        return
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object:
        if schema.get("additionalProperties") is not False:
            yield f"{path}: objects must set additionalProperties to false"
        props = set(schema.get("properties", {}))
        missing = props - set(schema.get("required", []))
        if missing:
            yield f"{path}: every property must be required (missing: {sorted(missing)})"
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            yield from _strict_problems(sub, f"{path}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            yield from _strict_problems(sub, f"{path}/{key}/{i}")
    if isinstance(schema.get("items"), dict):
        yield from _strict_problems(schema["items"], f"{path}/items")
