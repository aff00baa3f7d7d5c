"""One flag idiom: every flag of every service reads the variable derived from its name
(``--some-flag`` -> ``TANDEM_SOME_FLAG``), lists it in ``--help``, yields to the flag given on
the command line, and the names used before the idiom still work, with a warning."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from services.common.options import Options, Spec, env_var, option
from services.gateway import config as gateway
from services.gateway.keys import ApiKey
from services.router import __main__ as router
from services.worker import config as worker

SERVICES: dict[str, Callable[[Mapping[str, str]], Options]] = {
    "gateway": gateway.options,
    "router": router.options,
    "prefill": functools.partial(worker.options, "prefill"),
    "decode": functools.partial(worker.options, "decode"),
}
# What the required options get while another one is under test.
REQUIRED = {"TANDEM_MODEL_DIR": "/models/m", "TANDEM_ETCD": "e:1", "TANDEM_ROUTER": "r:1"}
# The variables of the issue that renamed them, and what each is called now.
RENAMED = {
    "router": {
        "ETCD_ENDPOINTS": "TANDEM_ETCD",
        "TANDEM_ETCD_ENDPOINTS": "TANDEM_ETCD",
        "TANDEM_ROUTER_POLICY": "TANDEM_POLICY",
        "TANDEM_ROUTER_KV_LOAD_WEIGHT": "TANDEM_KV_LOAD_WEIGHT",
        "TANDEM_API_KEYS": "TANDEM_API_KEY",
    },
    "decode": {
        "ETCD_ENDPOINTS": "TANDEM_ETCD",
        "TANDEM_ETCD_ENDPOINTS": "TANDEM_ETCD",
        "TANDEM_MAX_BATCHED_TOKENS": "TANDEM_MAX_NUM_BATCHED_TOKENS",
        "KV_LEASE_SECONDS": "TANDEM_LEASE_SECONDS",
        "TANDEM_KV_LEASE_SECONDS": "TANDEM_LEASE_SECONDS",
    },
    "gateway": {"TANDEM_ROUTERS": "TANDEM_ROUTER", "TANDEM_API_KEYS": "TANDEM_API_KEY"},
}


# Options whose values are checked beyond their kind: two good values each.
GOOD = {
    "--log-level": ("DEBUG", "warning"),
    "--speculative-config": (
        '{"num_speculative_tokens": 3}',
        '{"method": "ngram", "num_speculative_tokens": 5}',
    ),
    "--quantization": ("fp8", ""),  # empty: none
}


def sample(spec: Spec, other: bool = False) -> tuple[str, Any]:
    """A value for ``spec`` as text, and what the config must then hold (``other``: a second,
    different one)."""
    kind, choices = spec.kind, spec.option.choices
    if spec.flag in GOOD:
        text = GOOD[spec.flag][other]
    elif choices:
        text = choices[-2] if other else choices[-1]
    else:
        text = {
            "str": "s",
            "str?": "s",
            "int": "7",
            "int?": "7",
            "float": "2.5",
            "float?": "2.5",
            "bool": "1" if spec.default is False else "0",
            "tuple": "a:1,b:2",
        }[kind]
        if other:
            flipped = "0" if text == "1" else "1"
            text = {"bool": flipped, "tuple": "c:3", "str": "s1"}.get(kind, "9")
    value = spec.read(text)
    return text, spec.option.convert(value) if spec.option.convert else value


def flag_args(spec: Spec, text: str) -> list[str]:
    if spec.kind == "bool":
        return [spec.flag if spec.read(text) else "--no-" + spec.flag[2:]]
    return [spec.flag, text]


@pytest.mark.parametrize("service", SERVICES)
def test_every_flag_reads_its_variable_and_lists_it(service: str) -> None:
    opts = SERVICES[service]({})
    declared = {f for a in opts.parser._actions for f in a.option_strings} - {"-h", "--help"}
    flags = {s.flag for s in opts.specs}
    negated = {"--no-" + s.flag[2:] for s in opts.specs if s.kind == "bool"}
    assert declared == flags | negated  # every flag comes from one declared option
    assert len(flags) == len(opts.specs) > 20
    text = " ".join(opts.parser.format_help().split())
    for spec in opts.specs:
        assert spec.env == env_var(spec.flag) == "TANDEM_" + spec.flag[2:].upper().replace("-", "_")
        assert f"[{spec.env}" in text, f"--help does not list {spec.env}"
        given, expected = sample(spec)
        env = {**REQUIRED, spec.env: given}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no deprecation: these are the current names
            values = SERVICES[service](env).values([])
        assert values[spec.path] == expected, f"{spec.env}={given} did not reach {spec.flag}"
        flag_text, flag_value = sample(spec, other=True)
        values = SERVICES[service](env).values(flag_args(spec, flag_text))
        assert values[spec.path] == flag_value, f"{spec.flag} does not win over {spec.env}"


@pytest.mark.parametrize("service", RENAMED)
def test_old_variable_names_work_with_a_warning(service: str) -> None:
    specs = {s.env: s for s in SERVICES[service]({}).specs}
    for old, new in RENAMED[service].items():
        spec = specs[new]
        assert old in spec.option.old_env
        given, expected = sample(spec)
        env = {**REQUIRED, old: given}
        env.pop(new, None)
        with pytest.warns(FutureWarning, match=f"{old} is deprecated; set {new}"):
            values = SERVICES[service](env).values([])
        assert values[spec.path] == expected
        other, other_value = sample(spec, other=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the new name, when set, is read and wins
            values = SERVICES[service]({**env, new: other}).values([])
        assert values[spec.path] == other_value


def test_bad_values_and_missing_required_options_exit_with_the_name() -> None:
    opts = SERVICES["decode"]({"TANDEM_MODEL_DIR": "/m", "TANDEM_PORT": "eighty"})
    with pytest.raises(SystemExit):
        opts.values([])
    with pytest.raises(SystemExit):
        SERVICES["router"]({"TANDEM_ETCD": "e:1"}).values([])  # no --model-dir


@dataclass(frozen=True, slots=True)
class Nested:
    depth: int = option(1, "a nested option")


@dataclass(frozen=True, slots=True)
class Sample:
    name: str = option("x", "a string")
    sizes: tuple[str, ...] = option((), "repeatable", flag="--size")
    limit: int | None = option(None, "optional int")
    fast: bool = option(False, "a switch")
    nested: Nested = Nested()
    derived: str = ""  # not an option: keeps its default


def test_configs_are_built_frozen_with_nested_options() -> None:
    env = {"TANDEM_DEPTH": "3", "TANDEM_LIMIT": ""}
    config = Options(Sample, "t", env=env).parse(["--size", "a,b", "--size", "c", "--fast"])
    assert config == Sample("x", ("a", "b", "c"), None, True, Nested(3))
    with pytest.raises(AttributeError):
        config.name = "y"  # type: ignore[misc]
    assert Options(Sample, "t", env={"TANDEM_SIZE": "p, q"}).parse([]).sizes == ("p", "q")
    assert Options(Sample, "t", env={}).parse(["--no-fast"]).fast is False


def test_gateway_keys_are_hashed_from_flag_and_variable() -> None:
    values = SERVICES["gateway"]({**REQUIRED, "TANDEM_API_KEY": "k1,k2:team"}).values([])
    keys = values[("api_keys",)]
    assert all(isinstance(k, ApiKey) for k in keys) and keys[1].tenant == "team"
    assert "k1" not in repr(keys)
