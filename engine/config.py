"""Frozen configuration of the model (from config.json) and of the engine (from the caller)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024**2
SPECULATIVE_METHODS = ("ngram", "draft_model")
# Async scheduling (engine.step_loop): launch step N+1 before reading step N back. The one
# default, shared by every flag that exposes it.
DEFAULT_ASYNC_SCHEDULING = True


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama- or Qwen2-family decoder, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope: RopeConfig
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{path} not found: expected a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()), Path(model_dir))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], model_dir: Path | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
            raise UnsupportedModelError("Qwen2 with use_sliding_window=true is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            rope=_rope_from(cfg),
            eos_token_ids=_eos_ids(cfg, model_dir),
            bos_token_id=cfg.get("bos_token_id"),
        )


def _rope_from(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older folders have rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def _eos_ids(cfg: dict[str, Any], model_dir: Path | None) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [cfg]
    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        sources.insert(0, json.loads((model_dir / "generation_config.json").read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        for e in eos if isinstance(eos, list) else [eos]:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return tuple(ids)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names.

    - ``ngram`` (prompt lookup): the drafts are the ``num_speculative_tokens`` tokens that
      followed the latest earlier occurrence of the sequence's last n tokens (n from
      ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its own history, prompt and
      output. As in vLLM, an unset bound takes the other's value, and both default to 5.
    - ``draft_model``: a smaller model (the folder ``model``, sharing the target's tokenizer)
      proposes ``num_speculative_tokens`` tokens greedily (``engine.draft_model``). As in vLLM,
      a config that names a ``model`` and no ``method`` means this one.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        method = "ngram" if self.method == "[ngram]" else self.method
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported; supported: "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, not {k!r}")
        object.__setattr__(self, "method", method)
        if method == "draft_model":
            self._check_draft()
            return
        if self.model is not None:
            raise ValueError("speculative method 'ngram' takes no 'model'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        assert lo is not None and hi is not None
        if lo < 1 or hi < lo:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_draft(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': the draft's folder")
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("prompt_lookup_min/max belong to method 'ngram', not 'draft_model'")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(
                f"speculative draft model {self.model!r}: no config.json there (a local Hugging "
                "Face folder is expected)"
            )

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """From a dict or a JSON object (``--speculative-config``); None or "" stays None.
        Unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max",
                 "prompt_lookup_min"}  # fmt: skip
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        if "method" not in value and value.get("model") is not None:
            value = {**value, "method": "draft_model"}
        return cls(**value)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs besides the model folder. Frozen; derived values are
    properties."""

    model_dir: str
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # "auto": cuda when available, else cpu
    load_format: str = "safetensors"  # or "dummy": random weights of the config's shapes
    block_size: int = 16
    # KV pool size, first that applies: ``num_kv_blocks``; ``kv_cache_bytes``; on CUDA what
    # ``gpu_memory_utilization`` leaves after weights, activations and CUDA graphs (see
    # engine.memory); on CPU ``DEFAULT_CPU_KV_CACHE_BYTES``.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # CUDA: the share of the device's *total* memory this engine may use for weights,
    # activations, CUDA graphs and its KV pool (vLLM's --gpu-memory-utilization). Several
    # engines on one device each take their own share.
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill + decodes)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    # CUDA only: decode steps replay graphs captured at these batch sizes (padded up to the
    # next one); enforce_eager turns graphs off.
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    # Ranks (processes, one device each) the model is split over (engine.parallel); on CUDA
    # rank r takes device cuda:r (cuda:k+r with device="cuda:k"). Memory settings are per rank.
    tensor_parallel_size: int = 1
    # Multi-LoRA (engine.lora): ``max_loras`` device slots, so at most that many adapters in one
    # step, each of rank <= ``max_lora_rank``. Off unless enabled: the slots take memory
    # (layers x 7 projections x slots x rank x (in + out) elements).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    # Speculative decoding (a SpeculativeConfig, or its dict / JSON form); None: off.
    speculative_config: SpeculativeConfig | None = None
    # FP8 (engine.fp8): "auto" keeps the KV cache in the model dtype, "fp8" (= "fp8_e4m3")
    # stores it in e4m3; quantization "fp8" holds the layers' matrices in e4m3.
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # With quantization "fp8": the LM head in e4m3 too (per-row scales; the embedding stays in
    # the model dtype, so a tied model holds both). A Tandem extension, off by default: vLLM
    # keeps the head unquantized.
    quantize_lm_head: bool = False
    # Checked KV (engine.kv_checksum): checksum each block once, when it is sealed (full and
    # computed), and keep the sum, so a hand-off only reads it (prefill workers turn this on).
    seal_checksums: bool = False
    # Async scheduling (vLLM's name; SGLang's overlap scheduler): each step() launches the next
    # forward pass while the previous one runs, reading that one's tokens back one step late
    # (outputs lag one call). Steps that need the tokens on the host first (grammars,
    # penalties, speculative decoding, ...) fall back to synchronous (engine.step_loop).
    async_scheduling: bool = DEFAULT_ASYNC_SCHEDULING

    @property
    def max_decode_rows(self) -> int:
        """Rows of the largest decode step (CUDA graphs are captured up to it): a token per
        sequence, each followed by its draft when speculating."""
        spec = self.speculative_config
        return self.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))

    @property
    def max_draft_rows(self) -> int:
        """Rows of the largest decode step of a draft model (``engine.draft_model``): its first
        pass feeds a caught-up sequence at most two tokens (its last draft token, kept, and the
        token after it), the later passes one."""
        return 2 * self.max_num_seqs

    def __post_init__(self) -> None:
        spec = SpeculativeConfig.parse(self.speculative_config)  # type: ignore[arg-type]
        object.__setattr__(self, "speculative_config", spec)
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs, max_num_batched_tokens must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, not {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, not {self.kv_cache_bytes}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, not {self.tensor_parallel_size}")
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative method 'draft_model' is not supported with tensor_parallel_size > 1 "
                "yet"
            )
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', not {self.kv_cache_dtype!r}"
            )
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', not {self.quantization!r}")
        if self.quantize_lm_head and self.quantization != "fp8":
            raise ValueError(
                "quantize_lm_head needs quantization='fp8' (the LM head is quantized like the "
                f"layers' matrices), not quantization={self.quantization!r}"
            )
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(
                f"load_format must be 'safetensors' or 'dummy', not {self.load_format!r}"
            )
