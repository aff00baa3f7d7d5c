"""Flags and environment variables: one idiom for every service.

Each option is declared once, as a field of the service's frozen config dataclass, whose default
is the option's default (mini-sglang's ``ServerArgs``)::

    @dataclass(frozen=True, slots=True)
    class RouterConfig:
        port: int = option(0, "gRPC port (0: a free one)")
        observability: ObservabilityConfig = ObservabilityConfig()  # its options are included

The flag is the field's name with dashes (``--port``) unless ``flag=`` names another, and its
environment variable is derived from the flag alone: ``--some-flag`` reads ``TANDEM_SOME_FLAG``
(`env_var`). ``--help`` lists each variable. A flag given on the command line wins over the
variable, the variable over the default. The field's type says how a value is read: ``str``,
``int``, ``float``, ``bool`` (``--flag``/``--no-flag``; variables take 1/0, true/false, yes/no,
on/off), ``int | None``, ``float | None`` and ``str | None`` (empty: None) and
``tuple[str, ...]`` (the flag repeated, or values separated by commas, as in the variable).
Variables named before this idiom (``old_env=``) are still read, with a deprecation warning,
when the new one is unset. Engine settings are declared once, in ``engine.config``
(``ENGINE_KNOBS``), and made options by `services.common.engine_options`.

Nothing else in a process reads the environment for its settings: ``__main__`` parses once
(`Options.parse`) and hands the frozen config down.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

ENV_PREFIX = "TANDEM_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
C = TypeVar("C")


def env_var(flag: str) -> str:
    """The environment variable of ``flag``: ``--some-flag`` -> ``TANDEM_SOME_FLAG``."""
    return ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()


@dataclass(frozen=True, slots=True)
class Option:
    """How one config field is set from the command line and the environment."""

    help: str
    flag: str = ""  # default: the field's name with dashes
    choices: tuple[str, ...] = ()
    required: bool = False
    old_env: tuple[str, ...] = ()  # former variable names: read with a deprecation warning
    also_env: tuple[str, ...] = ()  # standard variables read after ours (OTEL_EXPORTER_...)
    convert: Callable[[Any], Any] | None = None  # the parsed value -> the field's value
    raw: str = ""  # with convert: the kind read ("str" or "tuple"; default: from the field type)
    metavar: str | None = None
    secret: bool = False  # never shown in --help


def option(default: Any, help: str, **kw: Any) -> Any:
    """A config field that is also a flag and a variable (see the module docstring); a
    ``secret`` one is left out of the config's repr and its default out of ``--help``."""
    opt = Option(help, **kw)
    return field(default=default, repr=not opt.secret, metadata={"option": opt})


@dataclass(frozen=True, slots=True)
class Spec:
    """One declared option: where its value goes (``path`` of field names from the top config,
    nested configs included), how it is read, its flag and variable."""

    path: tuple[str, ...]
    option: Option
    kind: str  # str, int, float, bool, int?, float?, str?, tuple
    default: Any

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.path[-1].replace("_", "-")

    @property
    def env(self) -> str:
        return env_var(self.flag)

    @property
    def dest(self) -> str:
        return "__".join(self.path)

    @property
    def shown_default(self) -> str:
        """``default X`` as ``--help`` shows it; "" for a secret, an empty default, or a help
        that states its default in words."""
        opt = self.option
        quiet = opt.secret or self.default in (None, "", ()) or "default" in opt.help
        return "" if quiet else f"default {self.default}"

    @property
    def metavar(self) -> str:
        choices = "{" + ",".join(self.option.choices) + "}" if self.option.choices else ""
        return self.option.metavar or choices or self.path[-1].upper()

    def read(self, text: str) -> Any:
        """A value of this option's kind from its text (ValueError when it is not one)."""
        if self.kind == "bool":
            if text.strip().lower() not in _TRUE + _FALSE:
                raise ValueError(f"not a boolean: {text!r}")
            return text.strip().lower() in _TRUE
        if self.kind == "tuple":
            return tuple(v.strip() for v in text.split(",") if v.strip())
        if self.kind in ("int?", "float?", "str?") and not text.strip():
            return None
        value = {"int": int, "float": float, "int?": int, "float?": float}.get(self.kind, str)(text)
        if self.option.choices and value not in self.option.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(self.option.choices)}")
        return value


def kind_of(tp: Any) -> str:
    """How a field of type ``tp`` is read (`Spec.kind`)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return {int: "int?", float: "float?", str: "str?"}[inner]
    if typing.get_origin(tp) is tuple:
        return "tuple"
    return {str: "str", int: "int", float: "float", bool: "bool"}[tp]


def specs(cls: type, path: tuple[str, ...] = ()) -> Iterator[Spec]:
    """Every option of config class ``cls``, nested configs' options included, in order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("option")
        if opt is not None:
            kind = opt.raw or kind_of(hints[f.name])
            yield Spec((*path, f.name), opt, kind, f.default)
        elif dataclasses.is_dataclass(hints[f.name]) and _has_options(hints[f.name]):
            yield from specs(hints[f.name], (*path, f.name))


def _has_options(cls: type) -> bool:
    return any("option" in f.metadata for f in dataclasses.fields(cls)) or any(
        dataclasses.is_dataclass(t) and _has_options(t) for t in typing.get_type_hints(cls).values()
    )


class Options:
    """The command line of one service: an argparse parser built from config class ``cls``,
    reading variables from ``env`` (default: ``os.environ``)."""

    def __init__(
        self,
        cls: type,
        prog: str,
        description: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.cls = cls
        self.env = os.environ if env is None else env
        self.specs = list(specs(cls))
        self.parser = argparse.ArgumentParser(
            prog=prog,
            description=description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=f"Every flag --some-flag also reads the variable {ENV_PREFIX}SOME_FLAG.",
        )
        for spec in self.specs:
            self._add(spec)

    def _add(self, spec: Spec) -> None:
        opt = spec.option
        shown = f"; {spec.shown_default}" if spec.shown_default else ""
        kw: dict[str, Any] = {
            "dest": spec.dest,
            "default": argparse.SUPPRESS,
            "help": f"{opt.help} [{spec.env}{shown}]",
        }
        if spec.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["metavar"] = spec.metavar
            if spec.kind == "tuple":
                kw["action"] = "append"
            else:
                kw["type"] = spec.read
        self.parser.add_argument(spec.flag, **kw)

    def error(self, message: str) -> NoReturn:
        """Exit with the usage and ``message`` (status 2), as argparse does."""
        self.parser.error(message)

    def _from_env(self, spec: Spec) -> tuple[bool, Any]:
        for name in (spec.env, *spec.option.old_env, *spec.option.also_env):
            text = self.env.get(name)
            if text is None:
                continue
            if name in spec.option.old_env:
                warnings.warn(f"{name} is deprecated; set {spec.env}", FutureWarning, stacklevel=4)
            try:
                return True, spec.read(text)
            except ValueError as e:
                self.error(f"{name}={text!r}: {e}")
        return False, None

    def values(self, argv: Sequence[str] | None = None) -> dict[tuple[str, ...], Any]:
        """Each option's value (flag, else variable, else default), converted, by path."""
        given = vars(self.parser.parse_args(argv))
        out: dict[tuple[str, ...], Any] = {}
        for spec in self.specs:
            if spec.dest in given:
                value = given[spec.dest]
                if spec.kind == "tuple":
                    value = tuple(v for item in value for v in spec.read(item))
            else:
                found, value = self._from_env(spec)
                if not found:
                    if spec.option.required:
                        self.error(f"{spec.flag} (or {spec.env}) is required")
                    out[spec.path] = spec.default
                    continue
            if spec.option.convert is not None:
                try:
                    value = spec.option.convert(value)
                except (OSError, ValueError) as e:
                    self.error(f"{spec.flag}: {e}")
            out[spec.path] = value
        return out

    def parse(self, argv: Sequence[str] | None = None) -> Any:
        """The frozen config of ``cls`` from ``argv`` (default: ``sys.argv[1:]``) and the
        environment; exits through `error` on a bad value."""
        return build(self.cls, self.values(argv), ())


def build(cls: type[C], values: Mapping[tuple[str, ...], Any], path: tuple[str, ...]) -> C:
    """An instance of ``cls`` with ``values`` (by path) in its option fields, nested included;
    fields that are not options keep their defaults."""
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = (*path, f.name)
        if key in values:
            kwargs[f.name] = values[key]
        elif dataclasses.is_dataclass(hints[f.name]) and any(k[: len(key)] == key for k in values):
            kwargs[f.name] = build(hints[f.name], values, key)
    return cls(**kwargs)
