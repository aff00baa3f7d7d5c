"""Load weights from a Hugging Face safetensors folder, or make random ones of the same shapes.

Fuses q/k/v (and their Qwen2 biases) and gate/up into single matrices as it loads. The
"dummy" mode builds weights from config.json alone, for benchmarks of real shapes on GPU.
Under tensor parallelism each rank reads only its shard (``engine.parallel.shard``): rows of
the column-parallel matrices, columns of the row-parallel ones, rows of the vocab-parallel
embedding and LM head; norms are whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import UnsupportedModelError
from engine.fp8 import quantize_head, quantize_layer
from engine.model import LayerWeights, ModelWeights
from engine.parallel.shard import ModelShard

Range = tuple[int, int] | None  # rows (dim 0) or columns (dim 1) to keep; None: all


class _Tensors:
    """Name -> tensor over every *.safetensors file of a folder (index file or not)."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise UnsupportedModelError(f"no *.safetensors files in {model_dir}")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._where[name] = f
        self._handles: dict[Path, object] = {}
        self.device, self.dtype = device, dtype

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def scalar(self, name: str, default: float = 1.0) -> float:
        """A one-element tensor of the checkpoint as a float, or ``default`` if absent."""
        return float(self.get(name).float().item()) if name in self else default

    def get(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        """The tensor, or only ``rows``/``cols`` of it (read from disk without the rest)."""
        if name not in self._where:
            raise UnsupportedModelError(f"weight {name!r} missing from the checkpoint")
        f = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        handle = self._handles[f]
        if rows is None and cols is None:
            t = handle.get_tensor(name)  # type: ignore[attr-defined]
        else:
            part = handle.get_slice(name)  # type: ignore[attr-defined]
            r = slice(*rows) if rows else slice(None)
            t = part[r] if cols is None else part[r, slice(*cols)]
        return t.to(device=self.device, dtype=self.dtype)


@dataclass(frozen=True, slots=True)
class _Cuts:
    """Row and column ranges of each fused matrix for one shard (None: whole)."""

    q: Range
    kv: Range
    mlp: Range
    vocab: Range

    @classmethod
    def of(cls, config: ModelConfig, shard: ModelShard | None) -> _Cuts:
        if shard is None or shard.size == 1:
            return cls(None, None, None, None)
        d = config.head_dim
        return cls(
            q=(shard.heads[0] * d, shard.heads[1] * d),
            kv=(shard.kv_heads[0] * d, shard.kv_heads[1] * d),
            mlp=shard.intermediate,
            vocab=shard.vocab,
        )


def load_weights(
    model_dir: str | Path,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    shard: ModelShard | None = None,
    fp8: bool = False,
    fp8_head: bool = False,
) -> ModelWeights:
    """Read and fuse the checkpoint's weights (only ``shard``'s part of them); ``fp8``: quantize
    each layer's matrices as it is read (engine.fp8), so at most one layer is held in ``dtype``
    beside the rest; ``fp8_head``: the LM head (its shard's rows) too, apart from the
    embedding even when tied."""
    src = _Tensors(Path(model_dir), device, dtype)
    cut = _Cuts.of(config, shard)
    qkv_cuts, mlp_cuts = (cut.q, cut.kv, cut.kv), (cut.mlp, cut.mlp)

    def fused(names: list[str], cuts: tuple[Range, ...]) -> torch.Tensor:
        return torch.cat([src.get(n, r) for n, r in zip(names, cuts, strict=True)])

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv = [a + f"{x}_proj.weight" for x in "qkv"]
        bias = [a + f"{x}_proj.bias" for x in "qkv"]
        lw = LayerWeights(
            input_norm=src.get(p + "input_layernorm.weight"),
            qkv=fused(qkv, qkv_cuts),
            qkv_bias=fused(bias, qkv_cuts) if config.qkv_bias else None,
            o_proj=src.get(a + "o_proj.weight", cols=cut.q),
            post_norm=src.get(p + "post_attention_layernorm.weight"),
            gate_up=fused([m + "gate_proj.weight", m + "up_proj.weight"], mlp_cuts),
            down=src.get(m + "down_proj.weight", cols=cut.mlp),
            # FP8 KV scales of checkpoints that carry them (vLLM's names), else 1.0.
            k_scale=src.scalar(a + "k_scale"),
            v_scale=src.scalar(a + "v_scale"),
        )
        layers.append(quantize_layer(lw) if fp8 else lw)
    embed = src.get("model.embed_tokens.weight", cut.vocab)
    if config.tie_word_embeddings or "lm_head.weight" not in src:
        lm_head = embed
    else:
        lm_head = src.get("lm_head.weight", cut.vocab)
    head = quantize_head(lm_head) if fp8_head else lm_head
    return ModelWeights(embed, layers, src.get("model.norm.weight"), head)


def dummy_weights(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    shard: ModelShard | None = None,
    fp8: bool = False,
    fp8_head: bool = False,
) -> ModelWeights:
    """Random weights of the config's shapes (std 0.02; norms 1): for speed, not for text.
    ``fp8``, ``fp8_head``: as in `load_weights`.

    Drawn on ``device`` from a generator seeded with ``seed``, so every engine of one device
    type gets the same weights (an 8B model is drawn in seconds on a GPU, minutes on a CPU);
    the values differ between device types. A shard draws every whole matrix in the same
    order and keeps its part, so it holds exactly the unsharded model's values."""
    g = torch.Generator(device=device).manual_seed(seed)
    c = config
    cut = _Cuts.of(config, shard)

    def rand(*shape: int, rows: Sequence[tuple[int, int]] = (), cols: Range = None) -> torch.Tensor:
        """A whole matrix drawn; then only ``rows`` (ranges, concatenated) and ``cols`` kept."""
        t = torch.randn(*shape, generator=g, device=device)
        if rows:
            t = torch.cat([t[lo:hi] for lo, hi in rows])
        if cols:
            t = t[:, cols[0] : cols[1]]
        return (t * 0.02).to(dtype=dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    d = c.head_dim
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * d
    qkv_cut, gate_up_cut = _fused_rows(c, cut)
    vocab_cut = [cut.vocab] if cut.vocab else []
    layers = []
    for _ in range(c.num_layers):
        lw = LayerWeights(
            input_norm=ones(c.hidden_size),
            qkv=rand(qkv_rows, c.hidden_size, rows=qkv_cut),
            qkv_bias=rand(qkv_rows, rows=qkv_cut) if c.qkv_bias else None,
            o_proj=rand(c.hidden_size, c.num_heads * d, cols=cut.q),
            post_norm=ones(c.hidden_size),
            gate_up=rand(2 * c.intermediate_size, c.hidden_size, rows=gate_up_cut),
            down=rand(c.hidden_size, c.intermediate_size, cols=cut.mlp),
        )
        layers.append(quantize_layer(lw) if fp8 else lw)
    embed = rand(c.vocab_size, c.hidden_size, rows=vocab_cut)
    lm_head = embed if c.tie_word_embeddings else rand(c.vocab_size, c.hidden_size, rows=vocab_cut)
    head = quantize_head(lm_head) if fp8_head else lm_head
    return ModelWeights(embed, layers, ones(c.hidden_size), head)


def _fused_rows(c: ModelConfig, cut: _Cuts) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A shard's rows of the fused QKV and gate/up matrices ([] when whole)."""
    if cut.q is None or cut.kv is None or cut.mlp is None:
        return [], []
    k0, v0 = c.num_heads * c.head_dim, (c.num_heads + c.num_kv_heads) * c.head_dim
    inter = c.intermediate_size
    kv = cut.kv
    return (
        [cut.q, (k0 + kv[0], k0 + kv[1]), (v0 + kv[0], v0 + kv[1])],
        [cut.mlp, (inter + cut.mlp[0], inter + cut.mlp[1])],
    )
