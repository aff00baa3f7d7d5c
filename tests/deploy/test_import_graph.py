"""No circles between files, and the package layering holds.

Every ``import`` statement of every ``.py`` file under the packages below counts: at module
level, inside functions and under ``if TYPE_CHECKING:`` (a circle that only type checking or a
deferred import closes is still a circle a reader must hold in mind). ``from pkg import name``
points at ``pkg/name.py`` when that is a module, else at ``pkg/__init__.py``; ``import a.b``
points at ``a/b.py`` (or ``a/b/__init__.py``). The packages' own ``__init__.py`` files are not
counted as imported by their submodules: Python runs them first, but they are only faces.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "libkv", "kernels", "services", "cli", "bench", "lab")

# Imports that may close a circle, each with its reason; every other edge counts. None now:
# an entry needs a reason a reviewer accepts, and leaves as soon as it no longer closes one.
ALLOWED_EDGES: dict[tuple[str, str], str] = {}

# What each package must never import (the documented layering: libkv <- engine <- services,
# and the command line and benchmarks on top).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "libkv": ("engine", "services", "cli", "bench", "lab"),
    "kernels": ("engine", "libkv", "services", "cli", "bench", "lab"),
    "engine": ("services", "cli", "bench", "lab"),
    "services": ("cli", "bench", "lab"),
}


def module_file(dotted: str, root: Path = ROOT) -> str | None:
    """The file of module ``dotted`` under ``root`` (relative, posix), or None if not ours."""
    base = root.joinpath(*dotted.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand.relative_to(root).as_posix()
    return None


def _package_of(rel: str) -> list[str]:
    """The dotted package a file's relative imports start from."""
    parts = rel.removesuffix(".py").split("/")
    return parts[:-1]


def imports_of(rel: str, root: Path = ROOT) -> set[str]:
    """Files (relative to ``root``) that file ``rel`` imports, anywhere in it."""
    tree = ast.parse((root / rel).read_text(), rel)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                for n in range(len(parts), 0, -1):  # the deepest of ours: a.b.c, else a.b ...
                    target = module_file(".".join(parts[:n]), root)
                    if target is not None:
                        out.add(target)
                        break
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = _package_of(rel)[: len(_package_of(rel)) - (node.level - 1)]
                base = ".".join([*pkg, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                target = module_file(f"{base}.{alias.name}", root) if base else None
                target = target or module_file(base, root)
                if target is not None:
                    out.add(target)
    out.discard(rel)
    return out


def build_graph(files: Iterable[str], root: Path = ROOT) -> dict[str, set[str]]:
    """File -> files it imports, among ``files``."""
    files = set(files)
    return {f: imports_of(f, root) & files for f in files}


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[tuple[str, ...]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def our_files(root: Path = ROOT) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix()
        for pkg in PACKAGES
        for p in (root / pkg).rglob("*.py")
        if "_pb2" not in p.name
    )


def test_no_cycles_between_files() -> None:
    graph = build_graph(our_files())
    for src, dst in ALLOWED_EDGES:
        graph[src].discard(dst)
    found = cycles(graph)
    assert not found, "files that import each other (directly or round a circle):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


def test_allowed_edges_still_close_a_circle() -> None:
    """An allowed import that no longer closes a circle must leave the list, so that it cannot
    come back unnoticed."""
    graph = build_graph(our_files())
    found = cycles(graph)
    closing = {(a, b) for a, b in ALLOWED_EDGES if b in graph[a] for c in found if {a, b} <= set(c)}
    stale = [e for e in ALLOWED_EDGES if e not in closing]
    assert stale == []


def test_packages_import_only_downwards() -> None:
    graph = build_graph(our_files())
    bad = sorted(
        f"{src} imports {dst}"
        for src, dsts in graph.items()
        for dst in dsts
        if dst.split("/")[0] in FORBIDDEN.get(src.split("/")[0], ())
    )
    assert bad == []


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A synthetic package whose circles close only through a function-local import, a
    TYPE_CHECKING import, a relative import and ``from pkg import module``: all are found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    import pkg.b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n"
    )
    (pkg / "c.py").write_text("from .sub import d\n")
    (pkg / "sub" / "d.py").write_text("from .. import c\n")
    (pkg / "e.py").write_text("import os\nfrom pkg import a\n")
    files = sorted(p.relative_to(tmp_path).as_posix() for p in pkg.rglob("*.py"))
    graph = build_graph(files, tmp_path)
    assert graph["pkg/e.py"] == {"pkg/a.py"}
    assert cycles(graph) == [("pkg/a.py", "pkg/b.py"), ("pkg/c.py", "pkg/sub/d.py")]
    assert cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
