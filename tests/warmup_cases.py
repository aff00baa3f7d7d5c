"""A mixed serving workload for the warm-up's tests (``tests/engine/test_warmup_record.py``
on the CPU,
``tests/gpu/test_warmup_gpu.py`` on a GPU): requests arriving a few per step, so decode batches take
many sizes; prompts from one token to the context limit (chunked where longer than the token
budget); n > 1; greedy and sampled with top-k / top-p, seeds and logprobs; adapters where given."""

from __future__ import annotations

import random
from collections.abc import Sequence

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def random_params(rng: random.Random, max_tokens: int) -> SamplingParams:
    sampled = rng.random() < 0.4
    return SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        n=rng.choice([1, 1, 1, 2, 3]),
        temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
        top_k=rng.choice([0, 20]) if sampled else 0,
        top_p=rng.choice([1.0, 0.9]) if sampled else 1.0,
        seed=rng.choice([None, 7]) if sampled else None,
        logprobs=rng.choice([None, None, 2]),
    )


def serve_mixed(
    engine: LLMEngine, seed: int, requests: int = 40, max_tokens: int = 24,
    loras: Sequence[str] = (),
) -> int:  # fmt: skip
    """Serve ``requests`` random requests to the end; returns the steps run."""
    rng = random.Random(seed)
    limit = engine.max_model_len
    vocab = engine.model_config.vocab_size
    pending = []
    for i in range(requests):
        n = rng.choice([1, 4, 17, 60, limit // 2, limit - 2, rng.randint(1, limit - 2)])
        params = random_params(rng, rng.randint(1, min(max_tokens, limit - 1 - n)))
        prompt = [rng.randrange(5, min(vocab, 4000)) for _ in range(n)]
        lora = rng.choice([None, *loras]) if loras else None
        pending.append((f"r{i}", prompt, params, lora))
    steps = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            if pending:
                rid, prompt, params, lora = pending.pop()
                engine.add_request(rid, prompt, params, lora=lora)
        engine.step()
        steps += 1
    engine.check_integrity()
    return steps
