"""Each engine knob is declared once (``engine.config.ENGINE_KNOBS``): the workers' flags, the
launcher's (``tandem serve``, ``tandem bench --stack``) and every ``--help`` show its one
default and help, and a knob given to the launcher reaches the workers' engine config."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from cli.main import build_parser
from engine.config import ENGINE_KNOBS, EngineConfig
from services.common.engine_options import engine_spec
from services.launcher.options import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    OWN_KNOBS,
    PASSED_KNOBS,
    add_worker_options,
    worker_overrides,
)
from services.launcher.stack import StackConfig
from services.worker import config as worker


def launcher_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_worker_options(p)
    return p


def flag_help(parser: argparse.ArgumentParser, flag: str) -> str:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return action.help or ""


def help_text(argv: list[str]) -> str:
    """What ``tandem ARGV --help`` prints, whitespace collapsed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return " ".join(out.getvalue().split())


@pytest.mark.parametrize("role", worker.ROLES)
def test_the_workers_flags_are_the_declarations(role: str) -> None:
    specs = {s.path[-1]: s for s in worker.options(role, {}).specs}
    for name, knob in ENGINE_KNOBS.items():
        spec = specs[name]
        assert spec.default == knob.default == EngineConfig.__dataclass_fields__[name].default
        assert spec.option.help == knob.help and spec.option.choices == knob.choices
        assert spec.flag == engine_spec(name).flag == "--" + name.replace("_", "-")


def test_every_knob_is_a_launcher_flag_or_set_by_one() -> None:
    assert set(PASSED_KNOBS).isdisjoint(OWN_KNOBS)
    assert set(PASSED_KNOBS) | set(OWN_KNOBS) == set(ENGINE_KNOBS)
    p = launcher_parser()
    flags = {f for a in p._actions for f in a.option_strings}
    for name in PASSED_KNOBS:
        knob, spec = ENGINE_KNOBS[name], engine_spec(name)
        text = flag_help(p, spec.flag)
        assert text.startswith(knob.help), name
        if knob.default is not None and "default" not in knob.help:
            assert f"[default {knob.default}" in text, f"{spec.flag}: {text}"
    for name, replaced_by in OWN_KNOBS.items():
        assert set(replaced_by.split(", ")) <= flags, name
    assert "default 1" in flag_help(p, "--prefill-tp")  # the workers' --tensor-parallel-size


def test_every_help_shows_the_same_default() -> None:
    """`python -m services.prefill --help`, `... decode --help`, `tandem serve --help` and
    `tandem bench --help` show each knob's default; the launcher adds its CPU policy."""
    texts = {
        role: " ".join(worker.options(role, {}).parser.format_help().split())
        for role in worker.ROLES
    }
    texts |= {cmd: help_text([cmd]) for cmd in ("serve", "bench")}
    for name in PASSED_KNOBS:
        knob, spec = ENGINE_KNOBS[name], engine_spec(name)
        if not spec.shown_default:
            continue
        declared = " ".join(knob.help.split())
        for where, text in texts.items():
            end = text.index(declared) + len(declared)  # the flag's help, then its [notes]
            assert spec.shown_default in text[end : end + 60], (where, name)
    batched = "tokens per engine step (the prefill chunk)"
    for where, text in texts.items():
        assert batched in text and "default 512" in text, where
    for cmd in ("serve", "bench"):
        assert f"on CPU {CPU_MAX_NUM_BATCHED_TOKENS}" in texts[cmd]
    assert StackConfig("/m", "/r").max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS


def test_launcher_knobs_reach_the_workers_engine_config() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    args = launcher_parser().parse_args(
        ["--gpus", "none", "--kv-cache-dtype", "fp8", "--quantization", "fp8",
         "--quantize-lm-head", "--no-async-scheduling", "--speculative-config", json.dumps(spec),
         "--max-loras", "2", "--max-num-seqs", "8", "--dtype", "bfloat16"]
    )  # fmt: skip
    out = worker_overrides(args)
    assert out["max_num_seqs"] == 8 and out["dtype"] == "bfloat16"  # StackConfig fields
    config = StackConfig("/m", "/r", **out)
    argv = ["--model-dir", "/m", *config.worker_option_args(), *config.worker_args]
    engine = worker.parse_config("decode", argv, {}).engine_config()
    assert (engine.kv_cache_dtype, engine.quantization, engine.quantize_lm_head) == (
        "fp8", "fp8", True,
    )  # fmt: skip
    assert engine.async_scheduling is False and engine.max_loras == 2
    assert engine.speculative_config is not None
    assert engine.speculative_config.num_speculative_tokens == 3
    assert (engine.max_num_seqs, engine.dtype) == (8, "bfloat16")
    assert engine.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS  # the CPU policy
    # Nothing given: nothing passed, the workers keep their defaults.
    bare = worker_overrides(launcher_parser().parse_args(["--gpus", "none"]))
    assert bare == {"gpus": ()}


def test_launcher_refuses_bad_knob_values_before_starting() -> None:
    p = launcher_parser()
    with pytest.raises(SystemExit, match="num_speculative_tokens"):
        worker_overrides(p.parse_args(["--gpus", "none", "--speculative-config", "{}"]))
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp16"])
