"""Engine knobs as command-line options: each flag parser that exposes an engine setting (the
worker's, and the launcher's behind ``tandem serve`` and ``tandem bench --stack``) takes its
default, help and values from the setting's one declaration, ``engine.config.ENGINE_KNOBS``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from engine.config import ENGINE_KNOBS, EngineConfig
from services.common.options import Spec, kind_of, option


def engine_option(name: str, **kw: Any) -> Any:
    """A config field (`services.common.options.option`) for engine knob ``name``: its default,
    help, choices and metavar are the declaration's; ``kw`` adds what only the command line
    has (``old_env=``). A knob with a ``parse`` is read as text and converted by it."""
    k = ENGINE_KNOBS[name]
    read = {"convert": k.parse, "raw": "str"} if k.parse else {}
    return option(k.default, k.help, choices=k.choices, metavar=k.metavar, **read, **kw)


def engine_spec(name: str) -> Spec:
    """Engine knob ``name`` as an option: its flag (``--max-num-seqs``), how its text is read
    (`Spec.read`, as the worker reads it), its default and help."""
    f = engine_option(name)
    opt = f.metadata["option"]
    kind = opt.raw or kind_of(_knob_type(name))
    return Spec((name,), opt, kind, f.default)


def _knob_type(name: str) -> Any:
    """Engine knob ``name``'s type: its annotation resolved alone, in ``engine.config``'s
    namespace (not the whole class's hints: a field that is not a knob may name a type imported
    only for type checking, as ``kernels: KernelChoices | None`` does to keep torch out)."""
    (f,) = [f for f in dataclasses.fields(EngineConfig) if f.name == name]
    if not isinstance(f.type, str):
        return f.type
    return eval(f.type, vars(sys.modules[EngineConfig.__module__]))  # the module's own text
