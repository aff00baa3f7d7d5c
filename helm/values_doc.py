"""The values table of helm/tandem/README.md, generated from the `# --` comments of values.yaml.

    python helm/values_doc.py           # rewrite the table in the README
    python helm/values_doc.py --check   # exit 1 when the README's table is stale

A `# -- text` comment (continued by the `#` lines under it) documents the key on the next line;
the table lists each documented key with its type and default. Keys inside a documented key
(e.g. `resources.requests`) and list items are covered by it. tests/deploy/test_helm_values_doc.py
checks that the table is current and that every key is covered.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent / "tandem"
START, END = "<!-- values-table:start -->", "<!-- values-table:end -->"
KEY = re.compile(r"^(\s*)([A-Za-z0-9_.-]+):(\s|$)")


@dataclass(frozen=True)
class Entry:
    """One key of values.yaml: its dotted path and its `# --` description ('' when none)."""

    path: str
    doc: str


def entries(text: str) -> list[Entry]:
    """Every mapping key outside lists, in file order, with its description."""
    out: list[Entry] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing keys
    doc: list[str] | None = None
    skip_deeper_than: int | None = None  # inside a list: skip until dedent
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_deeper_than is not None and (not stripped or indent > skip_deeper_than):
            continue
        skip_deeper_than = None
        if stripped.startswith("# --"):
            doc = [stripped[4:].strip()]
        elif stripped.startswith("#") and doc is not None:
            doc.append(stripped[1:].strip())
        elif stripped.startswith("- "):
            skip_deeper_than = stack[-1][0] if stack else -1
            doc = None
        elif match := KEY.match(line):
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match.group(2)))
            out.append(Entry(".".join(k for _, k in stack), " ".join(doc or [])))
            doc = None
        elif not stripped:
            doc = None
    return out


def lookup(values: dict[str, Any], path: str) -> Any:
    node: Any = values
    for part in path.split("."):
        node = node[part]
    return node


def type_name(value: Any) -> str:
    names = {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


def undocumented(text: str) -> list[str]:
    """Leaf keys (no keys under them) neither documented nor inside a documented key."""
    paths = [e.path for e in entries(text)]
    documented = [e.path for e in entries(text) if e.doc]
    leaves = [p for p in paths if not any(q.startswith(p + ".") for q in paths)]
    return [p for p in leaves if not any(p == d or p.startswith(d + ".") for d in documented)]


def table(text: str) -> str:
    values = yaml.safe_load(text)
    rows = ["| Key | Type | Default | Description |", "|-----|------|---------|-------------|"]
    for e in entries(text):
        if not e.doc:
            continue
        value = lookup(values, e.path)
        default = json.dumps(value, separators=(", ", ": ")).replace("|", "\\|")
        rows.append(f"| `{e.path}` | {type_name(value)} | `{default}` | {e.doc} |")
    return "\n".join(rows)


def render_readme(readme: str, values_text: str) -> str:
    """The README with the table between the markers replaced by a fresh one."""
    head, sep, rest = readme.partition(START)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"README lacks the {START} ... {END} markers")
    return f"{head}{START}\n{table(values_text)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail when the README table is stale")
    args = p.parse_args(argv)
    readme_path = CHART / "README.md"
    readme = readme_path.read_text()
    fresh = render_readme(readme, (CHART / "values.yaml").read_text())
    if args.check:
        if fresh != readme:
            print("helm/tandem/README.md is stale: run python helm/values_doc.py", file=sys.stderr)
            return 1
        return 0
    readme_path.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
