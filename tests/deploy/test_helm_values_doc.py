"""values.yaml is documented key by key, the chart README's values table is generated from it
and current, and values.schema.json describes exactly the keys values.yaml has."""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.helm_render import CHART, ROOT

sys.path.insert(0, str(ROOT / "helm"))
import values_doc  # noqa: E402

VALUES = (CHART / "values.yaml").read_text()


def test_every_value_is_documented() -> None:
    assert values_doc.undocumented(VALUES) == []


def test_readme_values_table_is_current() -> None:
    readme = (CHART / "README.md").read_text()
    assert values_doc.render_readme(readme, VALUES) == readme, "run python helm/values_doc.py"
    assert values_doc.main(["--check"]) == 0


def test_a_missing_comment_is_found() -> None:
    text = VALUES.replace("  # -- Router replicas", "  # Router replicas", 1)
    assert values_doc.undocumented(text) == ["router.replicas"]


def schema_paths(node: dict[str, Any], defs: dict[str, Any], prefix: str = "") -> dict[str, bool]:
    """Dotted path of every key the schema names -> whether it is a free-form map (whose own
    keys, like a label's name, are data rather than settings)."""
    out = {}
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        if "$ref" in sub:
            sub = defs[sub["$ref"].rsplit("/", 1)[1]]
        out[path] = sub.get("type") == "object" and "properties" not in sub
        out |= schema_paths(sub, defs, path + ".")
    return out


def test_schema_and_values_name_the_same_keys() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    paths = schema_paths(schema, schema["$defs"])
    maps = [p for p, is_map in paths.items() if is_map]
    in_schema = set(paths) - {"global"}
    in_values = {
        e.path
        for e in values_doc.entries(VALUES)
        if not any(e.path.startswith(m + ".") for m in maps)
    }
    assert in_values - in_schema == set()
    # Every schema key has a default in values.yaml, itself or as part of an enclosing value
    # (`affinity: {}`, `rollingUpdate: {maxSurge: 0, ...}`).
    orphans = {p for p in in_schema if not any(p == v or p.startswith(v + ".") for v in in_values)}
    assert orphans == set()
