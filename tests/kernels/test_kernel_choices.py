"""Kernel choices (``kernels.choices.KernelChoices``): one frozen value per model, chosen when it
loads, instead of ``kernels``' old module switches changed at run time.

On the CPU every call takes the references whatever the choices say, so a model built with
other choices must give the same logits bit for bit; the engine must hand its model the value
it was given (``EngineConfig.kernels``), or the device's defaults."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import kernels
from engine import EngineConfig, LLMEngine
from engine.config import ENGINE_KNOBS
from engine.model import DecoderModel, fold_norms
from kernels import KernelChoices
from kernels.choices import DEFAULT
from services.common.engine_options import engine_spec

# Every switch kernels/__init__.py (and triton_skinny) had before the choices: none may return.
OLD_SWITCHES = ("GEMV_MAX_ROWS", "SKINNY_KERNEL", "FUSE_DECODE", "FOLD_DECODE", "FOLD_DOT",
                "FOLD_SUMS", "FOLD_SUMS_MIN_ROWS", "ROPE_IN_ATTENTION", "PDL")  # fmt: skip
# Choices unlike the defaults in every field
OTHERS = KernelChoices(skinny_rows=0, fold_norms=False, fold_sums=False, fold_sums_min_rows=5,
                       rope_in_attention=False, pdl=False, flash_attention=True,
                       flash_decode=True)  # fmt: skip


def test_the_choices_are_frozen_and_checked():
    c = KernelChoices()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.pdl = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="skinny_rows"):
        KernelChoices(skinny_rows=9)  # more rows than the skinny kernel takes
    with pytest.raises(ValueError, match="fold_sums_min_rows"):
        KernelChoices(fold_sums_min_rows=0)
    assert all(getattr(OTHERS, f.name) != f.default for f in dataclasses.fields(KernelChoices))


def test_the_defaults_are_what_the_engine_served_with():
    """The values of the old switches on main: up to 8 rows on the skinny kernel, the norms
    folded with their sums from the product before from 2 rows, RoPE in decode attention, PDL
    (only where the GPU has it: off on the CPU)."""
    c = KernelChoices()
    assert (c.skinny_rows, c.fold_norms, c.fold_sums, c.fold_sums_min_rows) == (8, True, True, 2)
    assert c.rope_in_attention and c.pdl
    assert KernelChoices.for_device(torch.device("cpu")) == dataclasses.replace(c, pdl=False)


def test_flash_attention_is_chosen_only_where_it_can_serve():
    """FlashAttention 3 needs a Hopper, a bf16/fp16 pool and its extension: on the CPU ``auto``
    and ``triton`` leave it off, ``fa3`` is an error naming why, an unknown backend too."""
    cpu = torch.device("cpu")
    for backend in ("auto", "triton"):
        c = KernelChoices.for_device(cpu, torch.bfloat16, 128, backend)
        assert not c.flash_attention and not c.flash_decode
    with pytest.raises(ValueError, match="fa3: not a CUDA device"):
        KernelChoices.for_device(cpu, torch.bfloat16, 128, "fa3")
    with pytest.raises(ValueError, match="attention backend"):
        KernelChoices.for_device(cpu, torch.bfloat16, 128, "flashinfer")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model_dir="x", attention_backend="flashinfer")


def test_kernels_has_no_switches_left():
    """No module global of ``kernels`` is a setting to change: the old names are gone and every
    public global left is a function, class, module or the FP8 dtype."""
    assert not [name for name in OLD_SWITCHES if hasattr(kernels, name)]
    settings = [name for name, v in vars(kernels).items()
                if not name.startswith("_") and isinstance(v, (bool, int, float, str))]  # fmt: skip
    assert settings == []


def test_a_model_with_other_choices_gives_the_same_logits_on_the_cpu(qwen2_dir):
    """Each engine's model holds the choices it was built with (``EngineConfig.kernels``, else
    the device's); over the same weights, a decode step and a mixed prefill step give the same
    logits bit for bit with ``OTHERS`` as with the defaults, folded or not."""
    engines = [LLMEngine(EngineConfig(model_dir=str(qwen2_dir), max_num_batched_tokens=64,
                                      max_num_seqs=4, kv_cache_bytes=32 * 1024**2, kernels=k))
               for k in (None, OTHERS)]  # fmt: skip
    default, other = (e.runner.model for e in engines)
    assert default.choices == KernelChoices.for_device(torch.device("cpu"))
    assert other.choices is OTHERS
    w = default.w
    folded = dataclasses.replace(w, layers=[
        dataclasses.replace(lw, qkv=lw.qkv.clone(), gate_up=lw.gate_up.clone()) for lw in w.layers
    ])  # fmt: skip
    fold_norms(folded)
    for weights in (w, folded):
        pair = [DecoderModel(default.config, weights, 64, choices=c) for c in (DEFAULT, OTHERS)]
        assert pair[0].folded == (weights is folded) and pair[1].choices is OTHERS
        for seq_lens, q_lens in (([40, 9, 17], [1, 1, 1]), ([12, 20], [12, 4])):
            got = [_logits(m, seq_lens, q_lens) for m in pair]
            assert torch.equal(got[0], got[1]), (weights is folded, q_lens)


def _logits(model: DecoderModel, seq_lens: list[int], q_lens: list[int]) -> torch.Tensor:
    """The logits of one step's new tokens over a random paged cache (the same for every
    model: drawn from a fixed seed)."""
    from tests.kernel_cases import make_paged_batch

    c = model.config
    _, kv, meta = make_paged_batch(seq_lens, q_lens, block_size=16, num_heads=c.num_heads,
                                   num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                   num_layers=c.num_layers, dtype=torch.float32,
                                   device="cpu")  # fmt: skip
    t = sum(q_lens)
    ids = torch.arange(t) * 7 % c.vocab_size
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, q_lens, strict=True)])
    return model.logits(model.forward(ids, positions, kv, meta))


def test_the_choices_are_no_engine_flag_and_the_config_stays_torch_free():
    """``EngineConfig.kernels`` is for code (tests, benchmarks), not a command-line knob; the
    knobs' flags still derive from their annotations; ``engine.config`` imports no torch."""
    assert "kernels" not in ENGINE_KNOBS
    assert {name: engine_spec(name).kind for name in ("max_num_seqs", "num_kv_blocks")} == {
        "max_num_seqs": "int", "num_kv_blocks": "int?"}  # fmt: skip
    code = "import sys, engine.config; print('torch' in sys.modules, 'kernels' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
