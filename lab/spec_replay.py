"""Step times of speculative decoding on a random-weight shape (``lab.spec_decode --mode
replay``): one engine at batch 1, a step that verifies ``d`` drafted tokens timed for each
``d`` from 0 (a plain decode step) to ``k``; each replays a CUDA graph of ``d + 1`` rows."""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.bundled import DEFAULT_DIR
from engine.shapes import write_shape

WARMUP_STEPS = 2  # the first timed decode steps, left out of the medians


def steady_median(times: list[float]) -> float:
    """Median step time (ms) after the first ``WARMUP_STEPS`` steps, keeping at least the last
    step: a run may time only a step or two (a tiny ``--steps``, or a draft that keeps every
    token it proposes, so each step emits ``k + 1``)."""
    if not times:
        raise ValueError("no decode step was timed: --steps must be at least 1")
    return statistics.median(times[min(WARMUP_STEPS, len(times) - 1) :])


class Drafts:
    """Always drafts ``d`` tokens (random ones: a random-weight model keeps almost none, which
    is what is wanted here: the step's cost, not its output)."""

    def __init__(self, d: int, vocab: int) -> None:
        self.d, self.vocab = d, vocab

    def propose(self, seq, limit: int) -> list[int]:
        return torch.randint(0, self.vocab, (min(self.d, max(limit, 0)),)).tolist()

    def propose_all(self, seqs, limits) -> list[list[int]]:
        return [self.propose(s, n) for s, n in zip(seqs, limits, strict=True)]

    def retain(self, running) -> None:
        pass


def step_times(
    shape: str, k: int, context: int, steps: int = 40
) -> tuple[dict[int, float], dict[int, float]]:
    """Median wall time (ms, host included, synchronised) of a decode step verifying ``d``
    drafts, for ``d`` in 0..k; and the mean rows per step that replayed a CUDA graph (``d + 1``
    when verify steps go through the graphs, 0 when they run eagerly)."""
    tok = Path(os.environ.get("TANDEM_TOKENIZER_DIR", str(DEFAULT_DIR)))
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape(shape, Path(tmp) / shape, tok)
        engine = LLMEngine(
            EngineConfig(
                model_dir=str(folder),
                load_format="dummy",
                max_num_seqs=1,
                max_num_batched_tokens=context + 64,
                max_model_len=context + steps * (k + 1) + 64,
                num_kv_blocks=-(-(context + steps * (k + 1) + 64) // 16) + 8,
                speculative_config={"method": "ngram", "num_speculative_tokens": k},
            )
        )
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (context,)).tolist()
    out, graph_rows = {}, {}
    graphs = engine.runner.graphs
    for d in range(k + 1):
        engine.proposer = Drafts(d, vocab)  # type: ignore[assignment]
        engine.add_request(
            f"d{d}", prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
        )
        engine.step()  # the prefill
        rows0 = graphs.rows if graphs is not None else 0
        times = []
        while engine.has_unfinished():
            _sync()
            t0 = time.perf_counter()
            engine.step()
            _sync()
            times.append((time.perf_counter() - t0) * 1e3)
        out[d] = steady_median(times)
        graph_rows[d] = ((graphs.rows if graphs is not None else 0) - rows0) / max(len(times), 1)
        print(f"verify {d} drafts: {out[d]:.3f} ms ({graph_rows[d]:.2f} graph rows/step)",
              flush=True)  # fmt: skip
    return out, graph_rows


def draft_step_time(shape: str, draft_shape: str, k: int, context: int, steps: int = 40) -> float:
    """Median wall time (ms) of a whole draft-model step at batch 1: the draft (random weights
    of ``draft_shape``) proposes ``k`` tokens in ``k`` passes, then the target verifies them.
    Random weights keep almost no draft token, so every step drafts ``k``: its cost, not its
    gain."""
    gc.collect()  # the engines of step_times: their memory back to the device first
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    tok = Path(os.environ.get("TANDEM_TOKENIZER_DIR", str(DEFAULT_DIR)))
    total = context + steps + 64
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape(shape, Path(tmp) / shape, tok)
        draft = write_shape(draft_shape, Path(tmp) / draft_shape, tok)
        engine = LLMEngine(
            EngineConfig(
                model_dir=str(folder),
                load_format="dummy",
                max_num_seqs=1,
                max_num_batched_tokens=context + 64,
                max_model_len=total + k,
                num_kv_blocks=-(-(total + k) // 16) + 8,
                gpu_memory_utilization=0.5,  # both models and the small pools fit in half
                speculative_config={
                    "method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
                },
            )
        )  # fmt: skip
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (context,)).tolist()
    engine.add_request(
        "draft", prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    )
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        _sync()
        t0 = time.perf_counter()
        engine.step()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    s = engine.stats().spec
    graphs = engine.proposer.runner.graphs  # type: ignore[union-attr]
    graph_runs = (graphs.runs if graphs is not None else 0) / max(len(times), 1)
    ms = steady_median(times)
    print(f"draft {draft_shape} k={k} + verify: {ms:.3f} ms "
          f"({s.accepted_tokens}/{s.draft_tokens} kept; {graph_runs:.2f} of the draft's passes "
          "per step replayed its CUDA graphs)", flush=True)  # fmt: skip
    return ms


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
