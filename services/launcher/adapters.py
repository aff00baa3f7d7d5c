"""Which served model each ``--lora-modules`` adapter of a local stack belongs to.

A stack serving several base models gives each adapter to the workers of one model only: the
one its weights fit (every matrix the shape of that model's layer count and projections, as a
worker checks it, ``engine.lora_config``). Where several models fit (models of one shape), the
adapter's ``base_model_name_or_path`` picks the one it names, by served name or folder; where
that does not settle it, ``NAME=PATH@MODEL`` must. An adapter that fits no model, or several
without a pick, is an error naming the models tried, raised before anything starts. All of it
reads config and safetensors headers only (no torch).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from engine.config import ModelConfig
from engine.errors import InvalidAdapterError, UnsupportedModelError
from engine.lora_config import base_model_of, read_spec
from services.common.models import parse_lora_modules

SYNTAX = "NAME=PATH[@MODEL]"


def assign_adapters(specs: Sequence[str], models: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Served model name -> the ``NAME=PATH`` adapters its workers load at start, for every
    model of ``models`` (served name -> folder, the first first); ValueError says why an
    adapter has no model."""
    out: dict[str, list[str]] = {name: [] for name in models}
    for name, path in parse_lora_modules(specs):
        if name in models:
            raise ValueError(f"--lora-modules: adapter {name!r} has a served model's name")
        path, pinned = split_model(path, models)
        if pinned and (reason := unfit(name, path, models[pinned])):
            raise ValueError(f"--lora-modules {name}={path}@{pinned}: {reason}")
        out[pinned or model_of(name, path, models)].append(f"{name}={path}")
    return {name: tuple(adapters) for name, adapters in out.items()}


def split_model(path: str, models: Mapping[str, str]) -> tuple[str, str]:
    """(folder, the served model ``@MODEL`` picks, or "")."""
    folder, sep, model = path.rpartition("@")
    if not sep or Path(path).is_dir():
        return path, ""
    if model not in models:
        raise ValueError(
            f"--lora-modules {path}: no served model {model!r} ({SYNTAX}; served: "
            f"{', '.join(models)})"
        )
    return folder, model


def unfit(name: str, path: str, model_dir: str) -> str:
    """Why adapter ``name`` at ``path`` cannot be served on the model in ``model_dir`` ("": it
    can). The rank limit is the workers' (--max-lora-rank) and is not checked here."""
    try:
        read_spec(name, path, ModelConfig.from_dir(model_dir), max_rank=sys.maxsize)
    except (InvalidAdapterError, UnsupportedModelError, OSError, ValueError, KeyError) as e:
        return str(e) or type(e).__name__
    return ""


def names(base: str, model: str, folder: str) -> bool:
    """Whether ``base`` (an adapter's base_model_name_or_path) names the served model ``model``
    in ``folder``: a folder of this host by being it, else (a hub id such as ``org/Model``, or
    a path on the host that trained it) by its last part, the served name or folder name."""
    base = base.rstrip("/")
    if not base:
        return False
    local = Path(base).expanduser()
    if local.exists():
        return local.resolve() == Path(folder).expanduser().resolve()
    return local.name in (model, Path(folder).name)


def model_of(name: str, path: str, models: Mapping[str, str]) -> str:
    """The served model adapter ``name`` fits (see the module docstring)."""
    reasons = {model: unfit(name, path, folder) for model, folder in models.items()}
    fitting = [model for model, reason in reasons.items() if not reason]
    if not fitting:
        distinct = set(reasons.values())  # one reason for all: say it once
        tried = "; ".join(f"{m}: {r}" for m, r in reasons.items()) if len(distinct) > 1 else ""
        raise ValueError(
            f"--lora-modules {name}={path}: the adapter fits none of the served models "
            f"({', '.join(models)}): {tried or distinct.pop()}"
        )
    if len(fitting) == 1:
        return fitting[0]
    base = base_model_of(path)
    named = [model for model in fitting if names(base, model, models[model])]
    if len(named) == 1:
        return named[0]
    if not base:
        why = "names no base model (base_model_name_or_path)"
    else:
        why = f"its base model {base!r} names {'several' if named else 'none'} of them"
    raise ValueError(
        f"--lora-modules {name}={path}: the adapter fits several served models "
        f"({', '.join(fitting)}) and {why}: pick one with {name}={path}@MODEL"
    )
