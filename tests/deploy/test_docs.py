"""The README and docs/ say what the code does: the README keeps its two commands and stays a
page a user reads; every relative link and anchor in the docs resolves; every flag they name is
a flag of some parser in the repository (or of the outside tool named beside it); every
``tandem_*`` metric they name is one the services export."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from cli.main import build_parser
from services.gateway import config as gateway
from services.router import __main__ as router
from services.worker import config as worker

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS_INDEX = ROOT / "bench" / "results" / "README.md"
README_MAX_LINES = 400

# Flags of the outside tools the docs show commands for (etcd, Prometheus, Helm, Docker,
# kubectl, pip, pytest), which no parser of this repository declares.
EXTERNAL_FLAGS = {
    "--name", "--data-dir", "--listen-client-urls", "--advertise-client-urls",
    "--listen-peer-urls", "--initial-advertise-peer-urls", "--initial-cluster",
    "--client-cert-auth",
    "--config.file", "--storage.tsdb.path", "--web.listen-address",
    "--set", "--create-namespace",
    "--build-arg",
    "--no-deps", "--system-site-packages",
    "--durations", "--timeout",
    "--some-flag",  # the placeholder of the flag-to-variable rule
}  # fmt: skip
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9.-]*[a-z0-9](?![\w*-])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
METRIC = re.compile(r"\btandem_[a-z0-9_]*[a-z0-9](?![\w*.])")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^a-z0-9 -]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


@functools.cache
def _known_flags() -> frozenset[str]:
    """Every flag declared in the repository: the services' option parsers, the `tandem`
    command's, and every ``add_argument("--...")`` of a script (bench, lab, tools)."""
    parsers = [
        gateway.options({}).parser,
        router.options({}).parser,
        worker.options("prefill", {}).parser,
        worker.options("decode", {}).parser,
    ]
    top = build_parser()
    for action in top._subparsers._group_actions:  # the subcommands: serve, bench, demo, ...
        parsers.extend(action.choices.values())
    flags = {f for p in parsers for a in p._actions for f in a.option_strings}
    for source in ROOT.rglob("*.py"):
        if ".venv" in source.parts or "tests" in source.parts:
            continue
        flags.update(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", source.read_text()))
    return frozenset(flags)


@functools.cache
def _exported_metrics() -> frozenset[str]:
    """Metric names the services, engine and libkv declare (without the _total/_info suffix
    prometheus_client adds)."""
    names: set[str] = set()
    for package in ("services", "engine", "libkv"):
        for source in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r'"(tandem_[a-z0-9_]+)"', source.read_text()))
    return frozenset(names)


def test_readme_keeps_the_two_commands_and_stays_short() -> None:
    text = (ROOT / "README.md").read_text()
    assert "make serve" in text and "make test" in text
    assert len(text.splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("page", [*PAGES, RESULTS_INDEX], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_anchors_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target} does not resolve"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: no heading for #{anchor} in {path}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_named_exists(page: Path) -> None:
    known = _known_flags() | EXTERNAL_FLAGS
    known |= {"--no-" + f[2:] for f in known}
    unknown = sorted(set(FLAG.findall(page.read_text())) - known)
    assert not unknown, f"{page.name} names flags no parser declares: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_metric_named_is_exported(page: Path) -> None:
    exported = _exported_metrics()
    named = set(METRIC.findall(page.read_text()))
    unknown = sorted(
        name
        for name in named
        if name not in exported and re.sub(r"_(total|info)$", "", name) not in exported
    )
    assert not unknown, f"{page.name} names metrics nothing exports: {unknown}"
