"""Llama- and Qwen2-family decoder over a flattened varlen batch and a paged KV cache.

One forward pass takes the new tokens of many sequences at once (some prefilling a chunk,
some decoding one token), writes their K/V into paged slots and attends over each sequence's
cached prefix plus the new tokens. Q/K/V and gate/up projections are fused into one matmul
each; the weights are plain tensors (no nn.Linear) so the loader owns their layout. Under
tensor parallelism the weights are one rank's shard (``engine.parallel``): the model computes
its heads and MLP rows and ``comm`` sums or gathers across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import kernels
from engine.config import ModelConfig, RopeConfig
from engine.parallel.comm import TPComm
from engine.parallel.shard import ModelShard

if TYPE_CHECKING:
    from engine.lora import LoRABatch


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer. The matrices may be ``kernels.Fp8Weight`` (``engine.fp8``);
    ``k_scale``/``v_scale`` scale the layer's K/V in an FP8 KV cache."""

    input_norm: torch.Tensor
    qkv: torch.Tensor | kernels.Fp8Weight  # [(H + 2*Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor | kernels.Fp8Weight
    post_norm: torch.Tensor
    gate_up: torch.Tensor | kernels.Fp8Weight  # [2 * intermediate, hidden]
    down: torch.Tensor | kernels.Fp8Weight
    k_scale: float = 1.0
    v_scale: float = 1.0
    # The two norms' weights multiplied into the columns of qkv and gate_up (`fold_norms`);
    # input_norm and post_norm are then ones.
    folded: bool = False


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    # The embedding itself when tied; an ``Fp8Weight`` of its own with ``quantize_lm_head``.
    lm_head: torch.Tensor | kernels.Fp8Weight


@dataclass(slots=True)
class Carry:
    """What a piece of the forward pass hands on across attention (``DecoderModel.piece``):
    ``qkv``, the layer's QKV product (attention's input); ``stream``, the residual stream
    (folded: the stream itself; unfolded: the residual before the next norm); ``cos``/``sin``
    of the rows' positions, made by the first piece and read by every attention."""

    qkv: torch.Tensor
    stream: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def fold_norms(weights: ModelWeights) -> None:
    """Multiply each layer's RMSNorm weights into the columns of the product that follows the
    norm (``rms_norm(x) * g @ W.T == rms_norm(x) @ (W * g).T``), in place, and set the norms'
    weights to ones; the decode step then takes `kernels.rms_linear` and `kernels.linear_add`
    (``DecoderModel``'s folded forward): no RMSNorm or SiLU-and-multiply launches, the residual
    added in the products' epilogues. bf16/fp16 weights only (an FP8 weight's per-row scale
    cannot take a per-column factor); the products round ``W * g`` once to the weights' dtype."""
    for lw in weights.layers:
        if lw.folded:
            continue
        if isinstance(lw.qkv, kernels.Fp8Weight) or isinstance(lw.gate_up, kernels.Fp8Weight):
            raise ValueError("fold_norms takes bf16/fp16 weights, not FP8")
        lw.qkv.mul_(lw.input_norm.to(lw.qkv.dtype))
        lw.gate_up.mul_(lw.post_norm.to(lw.gate_up.dtype))
        lw.input_norm = torch.ones_like(lw.input_norm)
        lw.post_norm = torch.ones_like(lw.post_norm)
        lw.folded = True


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies with linear or llama3 scaling, in float32 exactly as transformers."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv


class DecoderModel:
    """The model: ``forward`` computes hidden states, ``logits`` projects the chosen rows."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        max_len: int,
        comm: TPComm | None = None,
        choices: kernels.KernelChoices = kernels.KernelChoices(),  # noqa: B008 - frozen
    ) -> None:
        self.config = config
        self.w = weights
        self.choices = choices  # which kernels every call takes, fixed at load
        self.comm = comm or TPComm(ModelShard.of(config, 1, 0))
        self.num_heads = self.comm.shard.num_heads  # this rank's (all of them at TP=1)
        self.num_kv_heads = self.comm.shard.num_kv_heads
        device, dtype = weights.embed.device, weights.embed.dtype
        inv = rope_inv_freq(config.rope, config.head_dim).to(device)
        # Computed like transformers: float32 outer product, then cos/sin, then cast.
        freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.scale = config.head_dim**-0.5
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.folded = bool(weights.layers) and all(lw.folded for lw in weights.layers)
        if self.folded:
            self._check_one_rank()

    def fold(self) -> None:
        """`fold_norms` of this model's weights (one rank, no LoRA): the decode step's
        norms and SiLU-and-multiply move into the products."""
        self._check_one_rank()
        fold_norms(self.w)
        self.folded = True

    def _check_one_rank(self) -> None:
        if self.comm.shard.size > 1:
            raise ValueError("folded norms (fold_norms) need one rank: the products add the "
                             "residual stream before the ranks' sums")  # fmt: skip

    @property
    def num_layers(self) -> int:
        return len(self.w.layers)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: kernels.AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """input_ids/positions: [T]; returns final-normed hidden states [T, hidden]. With
        ``lora``, each token's adapter adds its low-rank delta to the seven projections.

        The pieces' loop (`first_piece`, `piece`, `last_piece`, attention between them), as
        ``engine.mixed_graphs`` runs it with the pieces replayed from CUDA graphs."""
        carry = self.first_piece(input_ids, positions, lora)
        for i in range(self.num_layers - 1):
            carry = self.piece(i + 1, self.attention(i, carry, kv_cache, meta), carry, lora)
        o = self.attention(self.num_layers - 1, carry, kv_cache, meta)
        return self.last_piece(o, carry, lora)

    # -- the pieces around attention: one forward pass is first_piece, then per layer i its
    # attention and piece i + 1 (last_piece after the last layer). Every piece is row-wise (a
    # row's outputs depend on that row's inputs only) and touches no KV: only attention reads
    # other rows and the cache. Tensor parallelism's sums stay inside the pieces.
    def first_piece(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lora: LoRABatch | None = None
    ) -> Carry:
        """The embedding, the rows' RoPE cos/sin and layer 0's pre-attention (norm and QKV)."""
        if self.folded and lora is not None:
            raise ValueError("a model with folded norms takes no LoRA adapters")
        x = self.comm.embed(input_ids, self.w.embed)
        qkv, stream = self._pre(0, x, None, None, lora)
        return Carry(qkv, stream, self.cos[positions], self.sin[positions])

    def piece(self, i: int, o: torch.Tensor, carry: Carry, lora: LoRABatch | None = None) -> Carry:
        """Layer ``i - 1``'s post-attention from its attention output ``o`` (o_proj, the
        residual add, the MLP), then layer ``i``'s pre-attention; 1 <= i < num_layers."""
        x, stream, sums = self._post(i - 1, o, carry.stream, lora)
        qkv, stream = self._pre(i, x, stream, sums, lora)
        return Carry(qkv, stream, carry.cos, carry.sin)

    def last_piece(
        self, o: torch.Tensor, carry: Carry, lora: LoRABatch | None = None
    ) -> torch.Tensor:
        """The last layer's post-attention, then the final norm: the hidden states."""
        x, stream, _ = self._post(self.num_layers - 1, o, carry.stream, lora)
        eps, c = self.config.rms_norm_eps, self.choices
        if self.folded:  # x is the stream itself
            return kernels.rms_norm(x, self.w.norm, eps, choices=c)[0]
        return kernels.rms_norm(x, self.w.norm, eps, stream, c)[0]

    def attention(
        self, i: int, carry: Carry, kv_cache: torch.Tensor, meta: kernels.AttentionMetadata,
        rows: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Layer ``i``'s attention heads' output ``[rows, q_size]`` (o_proj's input) from the
        first ``rows`` rows of ``carry`` (all of them by default): RoPE, the KV write into
        ``meta``'s slots, paged attention. ``meta`` describes exactly those rows."""
        c = self.config
        t = carry.qkv.shape[0] if rows is None else rows
        q, k, v = carry.qkv[:t].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, c.head_dim)
        k = k.view(t, self.num_kv_heads, c.head_dim)
        v = v.view(t, self.num_kv_heads, c.head_dim)
        lw = self.w.layers[i]
        o = kernels.rope_attention(q, k, v, carry.cos[:t], carry.sin[:t], kv_cache, i, meta,
                                   self.scale, lw.k_scale, lw.v_scale, self.choices)  # fmt: skip
        return o.reshape(t, self.q_size)

    def _pre(self, i, x, stream, sums, lora) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s QKV product of its normed input, and the stream after it. Folded
        (`fold_norms`): ``x`` is the residual stream itself and ``rms_linear`` normalizes it in
        its epilogue (from ``sums``, its sums of squares, where the product that made it left
        them). Unfolded: the norm of ``x + stream`` (``stream``: the residual; None at layer 0),
        whose sum is the next residual."""
        lw = self.w.layers[i]
        if self.folded:
            qkv = kernels.rms_linear(x, lw.input_norm, self.config.rms_norm_eps, lw.qkv,
                                     lw.qkv_bias, sums=sums, choices=self.choices)  # fmt: skip
            return qkv, x
        parts = (("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size))
        return self._normed_product(i, x, stream, lw.input_norm, lw.qkv, lw.qkv_bias, lora, parts)

    def _post(self, i, o, stream, lora) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer ``i``'s o_proj of the attention output ``o`` and its MLP: ``(x, stream,
        sums)`` for the next `_pre`. Folded: the two products that end a block add the stream
        in their epilogues (and leave its sums of squares where their kernel can); x is the
        stream. Unfolded: x is the MLP's output (summed over the ranks), stream the residual."""
        lw, eps, c = self.w.layers[i], self.config.rms_norm_eps, self.choices
        if self.folded:
            s, sums = kernels.linear_add_sums(o, lw.o_proj, stream, c)
            act = kernels.rms_linear(s, lw.post_norm, eps, lw.gate_up, silu=True, sums=sums,
                                     choices=c)  # fmt: skip
            s, sums = kernels.linear_add_sums(act, lw.down, s, c)
            return s, s, sums
        h = kernels.linear(o, lw.o_proj, choices=c)
        if lora is not None:
            lora.add(i, "o_proj", h, o, c)
        h = self.comm.all_reduce(h)
        n = lw.gate_up.shape[0] // 2
        gate_up, residual = self._normed_product(
            i, h, stream, lw.post_norm, lw.gate_up, None, lora, (("gate_proj", n), ("up_proj", n))
        )
        act = kernels.silu_and_mul(gate_up, c)
        out = kernels.linear(act, lw.down, choices=c)
        if lora is not None:
            lora.add(i, "down_proj", out, act, c)
        return self.comm.all_reduce(out), residual, None

    def _normed_product(self, i, x, residual, norm, w, bias, lora, parts):
        """``linear(rms_norm(x + residual) * norm, w, bias)`` and the next residual, plus the
        adapters' deltas from the normed rows (``parts``: the adapter projections in the fused
        product's columns, with their widths)."""
        h, residual = kernels.rms_norm(x, norm, self.config.rms_norm_eps, residual, self.choices)
        out = kernels.linear(h, w, bias, self.choices)
        if lora is not None:
            lora.add_parts(i, parts, out, h, self.choices)
        return out, residual

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given hidden rows."""
        return self.comm.gather_vocab(
            kernels.linear(hidden, self.w.lm_head, choices=self.choices)
        ).float()
