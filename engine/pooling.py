"""Embeddings: a prompt's final hidden states pooled into one vector, and full-prompt logits.

Pooling follows the model folder's sentence-transformers config when it has one (``modules.json``
naming a ``Pooling`` module: CLS, mean or last token, and ``Normalize`` when listed). Otherwise
it is vLLM's default for generative models: the last token's final (normed) hidden state,
L2-normalised.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.errors import InvalidRequestError, KVCapacityError, UnsupportedModelError
from engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence
from libkv.hashing import encode_extra_keys
from libkv.kv_manager import PrefixHit

if TYPE_CHECKING:
    import itertools
    from collections.abc import Callable

    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from libkv.kv_manager import KVCacheManager

POOLING_MODES = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    mode: str = "last"
    normalize: bool = True

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> PoolingConfig:
        """The folder's sentence-transformers pooling, or last token + L2 norm without one."""
        modules_path = Path(model_dir) / "modules.json"
        if not modules_path.is_file():
            return cls()
        modules = json.loads(modules_path.read_text())
        types = [str(m.get("type", "")) for m in modules]
        pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
        normalize = any(t.endswith(".Normalize") for t in types)
        if pooling is None:
            return cls("last", normalize)
        cfg = json.loads((Path(model_dir) / pooling.get("path", "") / "config.json").read_text())
        for key, mode in (
            ("pooling_mode_lasttoken", "last"),
            ("pooling_mode_mean_tokens", "mean"),
            ("pooling_mode_cls_token", "cls"),
        ):
            if cfg.get(key):
                return cls(mode, normalize)
        on = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
        raise UnsupportedModelError(f"sentence-transformers pooling {on} is not supported")

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """One float32 vector from a prompt's hidden states [T, hidden]."""
        h = hidden.float()
        v = {"last": lambda: h[-1], "mean": lambda: h.mean(0), "cls": lambda: h[0]}[self.mode]()
        return F.normalize(v, dim=-1) if self.normalize else v


class PromptPasses:
    """Passes over one whole prompt outside the continuous batch: ``embed``, ``score`` and
    ``prompt_logprobs``; a part the engine holds.

    It borrows blocks from the engine's ``kv`` for the prompt and returns them at once, under
    the engine's ``lock``. ``validate`` checks a prompt as the engine checks a request's
    (raising its errors); ``check_lora`` resolves an adapter name (``engine.adapters``);
    ``counter`` numbers the engine's sequences (shared, so ids never repeat)."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        runner: ModelRunner,
        pooling: PoolingConfig,
        lock: threading.RLock,
        counter: itertools.count,
        validate: Callable[[list[int], SamplingParams], None],
        check_lora: Callable[[str | None], str],
    ) -> None:
        self.config, self.kv, self.runner, self.pooling = config, kv, runner, pooling
        self._lock, self._counter = lock, counter
        self._validate, self.check_lora = validate, check_lora

    def alone(self, prompt: list[int], lora: str | None, run: Callable) -> list:
        """``run(sched)`` on one-sequence steps over the whole prompt, outside the continuous
        batch, under the engine lock, in blocks borrowed from the pool and returned at once; a
        list of what each step gave. The steps are chunks of at most ``max_num_batched_tokens``
        (what the activation peak was measured for), each attending to the ones before."""
        params = SamplingParams(max_tokens=1)
        self._validate(prompt, params)
        with self._lock:
            adapter = self.check_lora(lora)
            rid = f"__alone-{next(self._counter)}"
            seq = Sequence(rid, list(prompt), params, -1, lora=adapter)
            salt = encode_extra_keys(None, adapter or None)
            if self.kv.admit(rid, PrefixHit([], []), 0, len(prompt), salt) is None:
                raise KVCapacityError("not enough free KV blocks for this prompt now; retry")
            try:
                blocks, step, out = self.kv.block_ids(rid), self.config.max_num_batched_tokens, []
                for lo in range(0, len(prompt), step):
                    sched = SchedulerOutput()
                    sched.add(ScheduledSeq(seq, min(step, len(prompt) - lo), blocks))
                    out.append(run(sched))
                    seq.num_computed = min(lo + step, len(prompt))
                return out
            finally:
                self.kv.free(rid)

    def embed(self, prompt: list[int], lora: str | None = None) -> torch.Tensor:
        """The prompt's embedding (float32 [hidden], on the CPU), pooled by ``self.pooling``."""
        hidden = torch.cat(self.alone(prompt, lora, self.runner.hidden_all))
        return self.pooling.pool(hidden).cpu()

    def prompt_logprobs(
        self, prompt: list[int], k: int = 0, lora: str | None = None
    ) -> list[TokenLogprob]:
        """For each prompt token after the first: its raw-model logprob and rank given the
        tokens before it, and the ``k`` most likely tokens there (vLLM's ``prompt_logprobs``;
        the first token has none). One prefill of the whole prompt outside the batch, as
        ``embed``; the prefix cache is not read, so every position is computed."""
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"prompt logprobs: top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {k})"
            )
        targets = prompt[1:]

        def run(sched: SchedulerOutput) -> list[TokenLogprob]:
            lo = sched.scheduled[0].seq.num_computed  # this chunk's rows: tokens lo, lo + 1, ...
            return self.runner.prompt_logprobs(sched, k, targets[lo : lo + sched.num_tokens])

        return [lp for part in self.alone(prompt, lora, run) for lp in part]

    def score(self, prompt: list[int], lora: str | None = None) -> torch.Tensor:
        """Float32 logits [len(prompt), vocab] of every prompt position (one paged prefill);
        used to check logits against a reference implementation."""
        return torch.cat(self.alone(prompt, lora, self.runner.logits_all))
