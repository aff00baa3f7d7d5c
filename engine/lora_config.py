"""PEFT LoRA adapter folders, read and checked without torch (the gateway validates with it).

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` as ``peft`` writes
them. Tandem serves LoRA on the seven projections of a decoder layer (q/k/v/o and gate/up/down);
the scale of an adapter is PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``. Which modules an adapter targets is read from the weight names themselves (so a
``target_modules`` regex or ``"all-linear"`` needs no interpretation here); the base model is
checked by shape: every matrix must fit the served model's layer count and projection sizes
(``base_model_name_or_path`` is a training-time path or hub id: `base_model_of` reads it for a
launcher that tells apart served models of one shape, but a worker does not compare it).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig
from engine.errors import InvalidAdapterError

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTN_MODULES + MLP_MODULES
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one projection of the served model."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "q_proj": (c.hidden_size, q),
        "k_proj": (c.hidden_size, kv),
        "v_proj": (c.hidden_size, kv),
        "o_proj": (q, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }[module]


def base_model_of(path: str | Path) -> str:
    """The ``base_model_name_or_path`` of an adapter folder's config ("" when it names none or
    cannot be read)."""
    try:
        cfg = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return ""
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    return base if isinstance(base, str) else ""


@dataclass(frozen=True, slots=True)
class LoRASpec:
    """A checked adapter folder: its rank, scale and the (layer, module) pairs it adapts."""

    name: str
    path: str
    rank: int
    scaling: float
    targets: frozenset[tuple[int, str]]
    tensor_names: dict[tuple[int, str], tuple[str, str]]  # (layer, module) -> (A name, B name)

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(m for _, m in self.targets)


def read_spec(name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoRASpec:
    """Read and check an adapter folder against the served model; InvalidAdapterError says why
    it cannot be served (missing files, other model's shapes, rank over ``max_rank``, targets
    or PEFT options Tandem does not implement)."""
    folder = Path(path)
    if not name or "\x00" in name:
        raise InvalidAdapterError("the adapter name must be a non-empty string")
    cfg_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise InvalidAdapterError(f"adapter {name!r}: {folder} is not a directory")
    for f in (cfg_path, weights_path):
        if not f.is_file():
            raise InvalidAdapterError(f"adapter {name!r}: {f.name} not found in {folder}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidAdapterError(f"adapter {name!r}: unreadable {CONFIG_FILE}: {e}") from e
    rank, scaling = _check_config(name, cfg, max_rank)
    shapes = _safetensors_shapes(weights_path, name)
    names = _pair_tensors(name, shapes, model, rank)
    return LoRASpec(name, str(folder), rank, scaling, frozenset(names), names)


def _check_config(name: str, cfg: dict, max_rank: int) -> tuple[int, float]:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidAdapterError(
            f"adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA"
        )
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
        "bias": cfg.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
    }
    bad = sorted(k for k, v in unsupported.items() if v)
    if bad:
        raise InvalidAdapterError(f"adapter {name!r}: unsupported PEFT options: {', '.join(bad)}")
    try:
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", 8))
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidAdapterError(f"adapter {name!r}: {CONFIG_FILE} needs an integer r") from e
    if not 1 <= rank <= max_rank:
        raise InvalidAdapterError(
            f"adapter {name!r}: rank {rank} is over the limit of {max_rank} (--max-lora-rank)"
            if rank > max_rank
            else f"adapter {name!r}: rank must be >= 1, not {rank}"
        )
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, scaling


def _safetensors_shapes(path: Path, name: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors header (8-byte length, then JSON)."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise InvalidAdapterError(f"adapter {name!r}: unreadable {WEIGHTS_FILE}: {e}") from e
    return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def _pair_tensors(
    name: str, shapes: dict[str, list[int]], model: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[str, str]]:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        m = _KEY.match(key)
        if m is None:
            raise InvalidAdapterError(
                f"adapter {name!r}: unsupported target {key!r}; Tandem serves LoRA on "
                f"{', '.join(LORA_MODULES)} of the decoder layers"
            )
        layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in LORA_MODULES or (block == "mlp") != (module in MLP_MODULES):
            raise InvalidAdapterError(
                f"adapter {name!r}: unsupported target module {module!r}; supported: "
                f"{', '.join(LORA_MODULES)}"
            )
        if layer >= model.num_layers:
            raise InvalidAdapterError(
                f"adapter {name!r} was trained for another base model: it adapts layer {layer} "
                f"but the served model has {model.num_layers} layers"
            )
        _check_shape(name, key, shapes[key], ab, module_shape(model, module), rank)
        found.setdefault((layer, module), {})[ab] = key
    if not found:
        raise InvalidAdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    out: dict[tuple[int, str], tuple[str, str]] = {}
    for target, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise InvalidAdapterError(
                f"adapter {name!r}: layer {target[0]} {target[1]} lacks lora_A or lora_B"
            )
        out[target] = (pair["A"], pair["B"])
    return out


def _check_shape(
    name: str, key: str, shape: list[int], ab: str, io: tuple[int, int], rank: int
) -> None:
    fan_in, fan_out = io
    want = [rank, fan_in] if ab == "A" else [fan_out, rank]
    if shape != want:
        raise InvalidAdapterError(
            f"adapter {name!r} does not fit the served model (another base model?): {key} has "
            f"shape {shape}, expected {want}"
        )
