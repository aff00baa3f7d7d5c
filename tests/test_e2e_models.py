"""Two base models behind one endpoint: real etcd and the services as processes on loopback,
SmolLM2-135M and a small random Llama, each with its own prefill and decode worker, one router
and one gateway serving both. Each model's greedy output equals its own engine's, its prompts
reach only its own workers, and /v1/models lists both."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from engine import LLM, SamplingParams
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.conftest import make_random_model_dir
from tests.stack_probe import worker_stats
from tests.test_e2e_stack import MODEL

OTHER = "tiny"
PROMPTS = ["The capital of France is a city that", "def fibonacci(n):\n    # the n-th one"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, smol_dir):
    return make_random_model_dir(tmp_path_factory.mktemp("models"), smol_dir, "llama", seed=5)


@pytest.fixture(scope="module")
def expected(smol_dir, other_dir):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    out = {}
    for name, folder in ((MODEL, smol_dir), (OTHER, other_dir)):
        llm = LLM(folder, num_kv_blocks=128)
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        out[name] = {
            "ids": ids,
            "tokens": [o.token_ids for o in llm.generate(ids, params)],
            "hidden": llm.engine.model_config.hidden_size,
        }
    return out


@pytest.fixture(scope="module")
def stack(smol_dir, other_dir, tmp_path_factory):
    config = StackConfig(
        model_dir=str(smol_dir),
        extra_models=(f"{OTHER}={other_dir}",),
        run_dir=str(tmp_path_factory.mktemp("models-stack")),
        port=free_port(),
        decode_only_threshold=4,  # prompts go prefill -> hand-off -> decode
        member_ttl=3,
        member_refresh=1.0,
    )
    assert config.worker_models() == {
        "prefill-0": MODEL, "decode-0": MODEL, "prefill-1": OTHER, "decode-1": OTHER,
    }  # fmt: skip
    with Stack(config) as s:
        yield s


def complete(stack: Stack, model: str, prompt: list[int]) -> httpx.Response:
    body = {
        "model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)


def test_two_models_side_by_side(stack, expected):
    r = httpx.get(f"{stack.url}/v1/models", timeout=10)
    assert [m["id"] for m in r.json()["data"]] == [MODEL, OTHER]
    jobs = [(m, i) for m in (MODEL, OTHER) for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {j: pool.submit(complete, stack, j[0], expected[j[0]]["ids"][j[1]]) for j in jobs}
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(stack.config.model_dir)  # both models use SmolLM2's tokenizer
    for (model, i), fut in futures.items():
        r = fut.result()
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == tok.decode(expected[model]["tokens"][i])
    # Each model's prompts were prefilled by its own prefill worker only.
    stats = worker_stats(stack)
    for worker, model in (("prefill-0", MODEL), ("prefill-1", OTHER)):
        assert stats[worker].prompt_tokens == sum(map(len, expected[model]["ids"]))


def test_embeddings_and_unknown_model(stack, expected):
    for model in (MODEL, OTHER):
        r = httpx.post(
            f"{stack.url}/v1/embeddings", json={"model": model, "input": PROMPTS[0]}, timeout=60
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["data"][0]["embedding"]) == expected[model]["hidden"]
    r = complete(stack, "nope", [1, 2, 3])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
