"""Frozen configuration of the model (from config.json) and of the engine (from the caller)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from engine.errors import UnsupportedModelError
from engine.speculative_config import SpeculativeConfig

if TYPE_CHECKING:  # (kernels imports torch; this module stays torch-free)
    from kernels.choices import KernelChoices

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024**2
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
class Knob:
    """An engine setting that command lines expose, declared once: the worker's flags
    (``services.worker.config``) and the launcher's (``tandem serve``, ``tandem bench
    --stack``) take its default and help from here. ``choices``: the values a text knob takes;
    ``parse``: text -> value, for a knob that is not a plain str, int, float or bool."""

    default: Any
    help: str
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None


def knob(default: Any, help: str, **kw: Any) -> Any:
    """An `EngineConfig` field that is also a `Knob` (its default is the field's)."""
    return field(default=default, metadata={"knob": Knob(default, help, **kw)})


SPECULATIVE_HELP = (
    "speculative decoding as a JSON object with vLLM's names: method ngram "
    "(num_speculative_tokens, prompt_lookup_max, prompt_lookup_min), e.g. "
    + json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    + ", or method draft_model (model: a draft folder sharing the tokenizer, "
    "num_speculative_tokens), e.g. "
    + json.dumps({"method": "draft_model", "model": "DIR", "num_speculative_tokens": 4})
    + " (default: off). Speculation runs where tokens are decoded: a prefill worker "
    "checks the value and loads nothing for it (no draft model, no room set aside)"
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs besides the model folder. Frozen; derived values are
    properties. The fields made with `knob` are the settings command lines expose
    (`ENGINE_KNOBS`), with their one default and help."""

    model_dir: str
    dtype: str = knob(
        "auto",
        "weights and KV (auto: float32 on CPU, bfloat16 on CUDA)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = knob(
        "auto",
        "cpu, cuda or cuda:N (auto: cuda when available); `tandem serve --gpus` places each "
        "worker through CUDA_VISIBLE_DEVICES instead",
    )
    load_format: str = knob(
        "safetensors",
        "safetensors: the folder's weights; dummy: seeded random weights of the folder's "
        "config.json shapes (benchmarks without downloads: python -m engine.shapes)",
        choices=("safetensors", "dummy"),
    )
    block_size: int = knob(16, "tokens per KV block")
    # KV pool size, first that applies: ``num_kv_blocks``; ``kv_cache_bytes``; on CUDA what
    # ``gpu_memory_utilization`` leaves after weights, activations and CUDA graphs (see
    # engine.memory); on CPU ``DEFAULT_CPU_KV_CACHE_BYTES``.
    num_kv_blocks: int | None = knob(None, "KV pool size in blocks (overrides a size in bytes)")
    kv_cache_bytes: int | None = knob(
        None,
        f"KV pool size in bytes (default: {DEFAULT_CPU_KV_CACHE_BYTES // 1024**2} MiB on CPU; on "
        "CUDA what --gpu-memory-utilization leaves after weights, activations and CUDA graphs)",
    )
    # The host tier (engine.host_store, libkv.host_tier): KV blocks of the prefix cache copied
    # to host memory, paged back instead of recomputed. None: auto (off on CPU hosts).
    kv_host_cache_gib: float | None = knob(
        None,
        "host-memory KV tier per worker in GiB: blocks of the prefix cache are copied to it and "
        "paged back instead of recomputed, for prefixes and preempted sequences (0: off; "
        "default: off on CPU hosts, on CUDA hosts min(2x the GPU KV pool, 30 percent of available "
        "RAM / GPUs))",
        metavar="GIB",
    )
    # The disk tier below it (engine.disk_store, libkv.disk_tier): blocks the host tier evicts
    # are written to one file per rank in this directory and read back instead of recomputed.
    kv_disk_cache_dir: str | None = knob(
        None,
        "directory on a local disk (NVMe) for a KV tier below the host tier: blocks the host "
        "tier evicts are written there and read back instead of recomputed (default: off; "
        "needs a host tier; the files are removed at exit)",
        metavar="DIR",
    )
    kv_disk_cache_gib: float | None = knob(
        None,
        "size of the disk KV tier per worker in GiB, preallocated at start (default: half the "
        "directory's free space / GPUs)",
        metavar="GIB",
    )
    # A host hit shorter than this is recomputed: a copy has a fixed cost, a few tokens in a
    # batched step next to none (docs/engine.md, "Host tier", has the estimate).
    kv_swap_min_tokens: int = knob(
        64,
        "host-tier hits (cached prefixes, preempted sequences) shorter than this many tokens "
        "are recomputed instead of paged back in",
    )
    # The share of the device's *total* memory (vLLM's --gpu-memory-utilization).
    gpu_memory_utilization: float = knob(
        0.9,
        "CUDA: share of the device's total memory this worker may use for weights, activations, "
        "CUDA graphs and KV (workers sharing a device each take their own share)",
    )
    max_num_seqs: int = knob(64, "sequences per batch")
    # The per-step token budget: chunked prefill and decodes share it.
    max_num_batched_tokens: int = knob(512, "tokens per engine step (the prefill chunk)")
    max_model_len: int | None = knob(
        None, "longest sequence (prompt + output) in tokens (default: the model's context)"
    )
    enable_prefix_caching: bool = True
    seed: int = 0
    # CUDA only: decode steps replay graphs captured at these batch sizes (padded up to the
    # next one); enforce_eager turns graphs off.
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    # CUDA only: other steps (prompt tokens, alone or beside decodes) of up to this many tokens
    # replay piecewise graphs (engine.mixed_graphs), padded to the next of mixed_graph_sizes.
    mixed_graph_max_tokens: int = knob(
        512,
        "CUDA: steps that compute prompt tokens (a prefill chunk, alone or beside decodes) of up "
        "to this many tokens replay piecewise CUDA graphs, attention run eagerly between them; "
        "larger steps, steps with LoRA adapters and --enforce-eager run eagerly (0: off)",
        metavar="TOKENS",
    )
    # CUDA only: decode graphs for batches of spread lengths (engine.cuda_graphs.SpreadGraphs).
    decode_spread_graphs: bool = knob(
        True,
        "CUDA: capture the decode graphs a second time with more splits per sequence in "
        "attention, replayed when a step's longest context is well above its mean (batches of "
        "spread lengths); more capture time and graph memory. Off under tensor parallelism",
    )
    mixed_graph_sizes: tuple[int, ...] = (
        16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
    )  # fmt: skip
    # Ranks (processes, one device each) the model is split over (engine.parallel); on CUDA
    # rank r takes device cuda:r (cuda:k+r with device="cuda:k"). Memory settings are per rank.
    tensor_parallel_size: int = knob(
        1,
        "ranks the model is split over, one process per device (rank r on cuda:r of what the "
        "worker sees); rank 0 serves gRPC, registers and schedules",
    )
    # Multi-LoRA (engine.lora): ``max_loras`` device slots, so at most that many adapters in one
    # step, each of rank <= ``max_lora_rank``. Off unless enabled: the slots take memory
    # (layers x 7 projections x slots x rank x (in + out) elements).
    enable_lora: bool = knob(
        False, "reserve LoRA slots so adapters can be loaded at run time (on with --lora-modules)"
    )
    max_loras: int = knob(4, "LoRA adapters in one batch (device slots, evicted LRU)")
    max_lora_rank: int = knob(64, "highest LoRA rank accepted (sizes the slots)")
    # A SpeculativeConfig, or its dict / JSON form; None: off.
    speculative_config: SpeculativeConfig | None = knob(
        None, SPECULATIVE_HELP, metavar="JSON", parse=SpeculativeConfig.parse
    )
    # FP8 (engine.fp8): "fp8" is "fp8_e4m3".
    kv_cache_dtype: str = knob(
        "auto",
        "the KV cache's element type: auto (the model dtype) or fp8 (e4m3 with per-layer scales; "
        "half the memory and hand-off bytes of bf16; CUDA needs compute capability 8.9+). "
        "Prefill and decode workers must agree",
        choices=("auto", "fp8", "fp8_e4m3"),
    )
    attention_backend: str = knob(
        "auto",
        "attention kernels: auto (FlashAttention 3 on Hopper for bf16/fp16 KV where its "
        "extension is installed, else Triton), triton, or fa3 (an error where FA3 cannot serve)",
        choices=("auto", "triton", "fa3"),
    )
    quantization: str | None = knob(
        None,
        "fp8: the layers' weight matrices in e4m3 with per-channel scales computed at load "
        "(FP8 tensor cores; CUDA needs compute capability 8.9+); default: none",
        choices=("fp8",),
        metavar="{fp8}",
    )
    # The embedding stays in the model dtype, so a tied model holds both.
    quantize_lm_head: bool = knob(
        False,
        "with --quantization fp8: the LM head in e4m3 too, with per-row scales (a Tandem "
        "extension; off by default, as vLLM keeps it in the model dtype): a decode step reads "
        "one byte per head weight instead of two, and every logit changes by the rounding",
    )
    # Checked KV (engine.kv_checksum): checksum each block once, when it is sealed (full and
    # computed), and keep the sum, so a hand-off only reads it (prefill workers turn this on).
    seal_checksums: bool = False
    # Async scheduling (vLLM's name; SGLang's overlap scheduler): each step() launches the next
    # forward pass while the previous one runs, reading that one's tokens back one step late
    # (outputs lag one call). Steps that need the tokens on the host first fall back to
    # synchronous (engine.step_loop).
    async_scheduling: bool = knob(
        DEFAULT_ASYNC_SCHEDULING,
        "launch each engine step while the previous one still runs on the device, reading its "
        "tokens back one step late (vLLM's async scheduling); steps that need them first "
        "(grammars, penalties, speculative decoding, ...) run synchronously. "
        "--no-async-scheduling: every step synchronous",
    )
    # CUDA with async scheduling: the next step planned late (engine.late_planning).
    late_planning: bool = knob(
        False,
        "CUDA, async scheduling: plan each step just before the step in flight is predicted "
        "to end (less the launch), not as soon as it is launched, so a request arriving "
        "meanwhile joins the next step instead of the one after (up to a step less TTFT)",
    )
    # Which kernels the model takes where there is a choice (kernels.choices); None: the
    # device's defaults, what the engine serves with. Tests and benchmarks compare others.
    kernels: KernelChoices | None = None

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
        if self.kv_host_cache_gib is not None and self.kv_host_cache_gib < 0:
            raise ValueError(f"kv_host_cache_gib must be >= 0, not {self.kv_host_cache_gib}")
        if self.kv_disk_cache_gib is not None and self.kv_disk_cache_gib < 0:
            raise ValueError(f"kv_disk_cache_gib must be >= 0, not {self.kv_disk_cache_gib}")
        if self.kv_swap_min_tokens < 0:
            raise ValueError(f"kv_swap_min_tokens must be >= 0, not {self.kv_swap_min_tokens}")
        if self.mixed_graph_max_tokens < 0:
            raise ValueError(
                f"mixed_graph_max_tokens must be >= 0, not {self.mixed_graph_max_tokens}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, not {self.tensor_parallel_size}")
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative method 'draft_model' is not supported with tensor_parallel_size > 1 "
                "yet"
            )
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        for name in ("load_format", "kv_cache_dtype", "attention_backend", "quantization"):
            value, declared = getattr(self, name), ENGINE_KNOBS[name]
            off = value is None and declared.default is None  # quantization None: none
            if value not in declared.choices and not off:
                raise ValueError(
                    f"{name} must be one of {', '.join(declared.choices)}, not {value!r}"
                )
        if self.quantize_lm_head and self.quantization != "fp8":
            raise ValueError(
                "quantize_lm_head needs quantization='fp8' (the LM head is quantized like the "
                f"layers' matrices), not quantization={self.quantization!r}"
            )


# Every `knob` field of EngineConfig by name: what the worker's and the launcher's flags show.
ENGINE_KNOBS: Mapping[str, Knob] = MappingProxyType(
    {f.name: f.metadata["knob"] for f in fields(EngineConfig) if "knob" in f.metadata}
)
