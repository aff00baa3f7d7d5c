"""Which kernel a model's forward takes where ``kernels`` offers a choice: one frozen value per
model, chosen when it loads and passed to every call that has a choice.

``ModelRunner`` builds it once (`KernelChoices.for_device`, or ``EngineConfig.kernels`` where a
test or a benchmark asks for another) and ``DecoderModel`` holds it; nothing changes it
afterwards, so the eager steps, the warm-up and the CUDA graphs captured from them all take the
same kernels. The defaults are what the engine serves with; the GPU measurements behind each are
in ``bench/results/decode_gpu_h100.md`` (the figures in its sessions 7-15) and ``lab/README.md``.
Off CUDA (or without Triton) every choice falls back to the references, whatever it says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class KernelChoices:
    """The kernel choices of one model (see the module docstring). Frozen.

    - ``skinny_rows``: matrix products of at most this many rows (decode of small batches) take
      the skinny Triton kernel (``triton_skinny``); more rows, cuBLAS (FP8 weights: the FP8
      tensor cores). 0: cuBLAS always.
    - ``fold_norms``: a bf16/fp16 model of one rank without LoRA or FP8 weights folds its
      norms' weights into the products at load (``engine.model.fold_norms``), and its decode
      step takes `kernels.rms_linear` and `kernels.linear_add_sums`: six launches a layer
      instead of ten (H100, 8B shape: 0.988x the unfolded step at batch 1).
    - ``fold_sums``, ``fold_sums_min_rows``: from that many rows, a product that ends a block
      leaves its output's sums of squares in its epilogue, so the folded norm after it is one
      launch on the tensor cores' plans too (0.962x at batch 8); at one row the norm's own
      pass before the loop was faster.
    - ``rope_in_attention``: RoPE and the new token's KV write of a decode batch inside decode
      attention (`kernels.rope_attention`), one launch a layer fewer.
    - ``pdl``: programmatic dependent launch where the GPU has it (Hopper and newer): the decode
      step's kernels launch while the previous one finishes and wait for its results in the
      kernel (5.52 against 5.77 ms for the 8B step at batch 1, logits bit for bit equal).
    - ``flash_attention``: steps that are not a pure decode batch (prefill chunks, mixed steps
      of chunks and decodes) take FlashAttention 3 (`kernels.flash_attn`) over a bf16/fp16
      pool instead of the Triton prefill kernel; ``flash_decode``: decode batches too, instead
      of the Triton split-KV decode kernel. Chosen at load where FA3 is installed and the GPU
      is a Hopper (`for_device`); the H200 figures behind them: ``bench/results/attention_h200.md``.
    """

    skinny_rows: int = 8
    fold_norms: bool = True
    fold_sums: bool = True
    fold_sums_min_rows: int = 2
    rope_in_attention: bool = True
    pdl: bool = True
    flash_attention: bool = False
    flash_decode: bool = False

    def __post_init__(self) -> None:
        if self.skinny_rows < 0 or self.skinny_rows > 8:
            raise ValueError(f"skinny_rows must be 0-8 (the skinny kernel's rows), got {self}")
        if self.fold_sums_min_rows < 1:
            raise ValueError(f"fold_sums_min_rows must be >= 1, got {self}")

    @classmethod
    def for_device(
        cls,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
        head_dim: int = 0,
        attention: str = "auto",
    ) -> KernelChoices:
        """The engine's choices on ``device`` for a KV pool of ``kv_dtype`` and ``head_dim``:
        the defaults, with ``pdl`` only where the GPU has programmatic dependent launch
        (compute capability 9.0 and up), and FlashAttention 3 per ``attention``: ``auto``
        where it can serve the pool (`kernels.flash_attn.unavailable_reason`), ``fa3``
        (an error where it cannot), ``triton`` never."""
        import torch

        from kernels import flash_attn

        pdl = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {attention!r} is not one of {ATTENTION_BACKENDS}")
        why: str | None = "not asked for"
        if attention != "triton" and kv_dtype is not None:
            why = flash_attn.unavailable_reason(device, kv_dtype, head_dim)
        if attention == "fa3" and why is not None:
            raise ValueError(f"--attention-backend fa3: {why}")
        fa3 = why is None
        return cls(pdl=pdl, flash_attention=fa3, flash_decode=fa3 and FLASH_DECODE)


# The attention backends a model can be loaded with (``EngineConfig.attention_backend``).
ATTENTION_BACKENDS = ("auto", "triton", "fa3")
# Whether decode batches take FA3 too where it serves the pool (see ``flash_decode``).
FLASH_DECODE = False

DEFAULT = KernelChoices()
