"""Offline API: ``LLM(model_dir).generate(prompts, params)`` and a streaming form."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate from a model folder in-process, with continuous batching underneath.

    ``tensor_parallel_size=N`` (like every ``EngineConfig`` field, a keyword) splits the model
    over N ranks: this process and N-1 child processes, one device each (``engine.parallel``);
    ``close()`` (or leaving a ``with`` block) stops them."""

    def __init__(self, model: str | Path, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model_dir=str(model), **engine_options))
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion together; outputs come back in prompt order, and for
        a prompt with ``n > 1`` choices, its ``n`` outputs in choice order.

        A prompt is a string or a list of token ids; a single prompt may be passed bare.
        ``lora``: a loaded adapter's name for every prompt, or one per prompt (None: base).
        """
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        params = _broadcast(sampling_params, len(batch))
        ids = [f"offline-{next(self._ids)}" for _ in batch]
        loras = [lora] * len(batch) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(batch):
            raise ValueError(f"got {len(loras)} adapters for {len(batch)} prompts")
        for rid, prompt, p, name in zip(ids, batch, params, loras, strict=True):
            self.engine.add_request(rid, prompt, p, lora=name)
        final: dict[tuple[str, int], RequestOutput] = {}
        while len(final) < sum(p.n for p in params):
            for out in self.engine.step():
                if out.finished:
                    final[(out.request_id, out.index)] = out
        return [final[(rid, i)] for rid, p in zip(ids, params, strict=True) for i in range(p.n)]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield one ``RequestOutput`` per generated token (``new_text`` holds the delta; with
        ``n > 1``, ``index`` tells the choices apart)."""
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished and not out.others_pending:
                            return
        finally:
            if self.engine.has_unfinished():
                with contextlib.suppress(KeyError):
                    self.engine.abort(rid)

    def chat(
        self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None
    ) -> RequestOutput:
        """Apply the model's chat template and generate one reply."""
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
