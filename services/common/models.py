"""Several base models behind one endpoint: how a model is named on the command line."""

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
