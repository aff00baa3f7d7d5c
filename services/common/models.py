"""Several base models behind one endpoint: how a model, and a LoRA adapter, is named on the
command line."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def parse_models(specs: Sequence[str]) -> dict[str, str]:
    """Served name -> folder from ``DIR`` (named after the folder) or ``NAME=DIR`` entries;
    ValueError when an entry is empty or a name repeats."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep:
            name, folder = "", spec
        folder = os.path.expanduser(folder.strip())
        name = name.strip() or Path(folder).name
        if not folder or not name:
            raise ValueError(f"expected DIR or NAME=DIR, got {spec!r}")
        if name in out:
            raise ValueError(f"model {name!r} is named twice")
        out[name] = folder
    return out


def parse_lora_modules(specs: Sequence[str]) -> list[tuple[str, str]]:
    """``NAME=PATH`` pairs (vLLM's ``--lora-modules``); ValueError says which one is wrong."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path or "," in name:
            raise ValueError(f"--lora-modules: expected NAME=PATH, got {spec!r}")
        if any(name == n for n, _ in out):
            raise ValueError(f"--lora-modules: adapter {name!r} given twice")
        out.append((name, path))
    return out
