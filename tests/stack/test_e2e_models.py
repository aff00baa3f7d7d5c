"""Two base models behind one endpoint: real etcd and the services as processes on loopback,
SmolLM2-135M and a small random Llama, each with its own prefill and decode worker, one router
and one gateway serving both. Each model's greedy output equals its own engine's, its prompts
reach only its own workers, and /v1/models lists both. The gateway keeps each model's context,
admission and readiness apart: a prompt too long for one only, one model's in-flight bound
reached, and one model's decode worker gone."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.conftest import make_random_model_dir
from tests.stack.test_e2e_stack import MODEL
from tests.stack_probe import metrics_of, worker_stats

# Two models' stacks side by side (about 40 s): `make test-stack`, which CI runs.
pytestmark = pytest.mark.stack

OTHER = "tiny"
PROMPTS = ["The capital of France is a city that", "def fibonacci(n):\n    # the n-th one"]
MAX_NEW = 8
INFLIGHT = 1100  # the gateway's bound of tokens in flight, per base model


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
        disagg_mode="length",  # placement by length alone, whatever the load
        member_ttl=3,
        member_refresh=1.0,
        gateway_args=(f"--max-inflight-tokens={INFLIGHT}",),
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


def test_context_length_is_each_models_own(stack):
    """SmolLM2's context is 8192 tokens, the tiny model's 1024: a 1030-token prompt runs on the
    first and gets the OpenAI 400 on the second."""
    prompt = [(7 * i) % 40000 + 10 for i in range(1030)]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{stack.url}/v1/completions", json={**body, "model": OTHER}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "is 1024 tokens" in err["message"]
    r = httpx.post(f"{stack.url}/v1/completions", json={**body, "model": MODEL}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1030


def test_one_models_overload_does_not_refuse_another(stack):
    """A long generation holds 1010 of the tiny model's 1100 tokens in flight: its next request
    gets 429, while SmolLM2's (which would not fit a shared bound) runs."""
    hog = {
        "model": OTHER, "prompt": list(range(10, 20)), "max_tokens": 1000, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    gateway = stack.scrape_targets()["gateway"]
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=hog, timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        more = {"prompt": list(range(10, 20)), "max_tokens": 100, "temperature": 0}
        refused = httpx.post(
            f"{stack.url}/v1/completions", json={**more, "model": OTHER}, timeout=60
        )
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "server_overloaded"
        assert f"model {OTHER}" in refused.json()["error"]["message"]
        small = {"prompt": list(range(10, 105)), "max_tokens": 5, "temperature": 0}
        ok = httpx.post(f"{stack.url}/v1/completions", json={**small, "model": MODEL}, timeout=300)
        assert ok.status_code == 200, ok.text
        # The hog was in flight the whole time (its 1010 tokens still booked).
        assert metrics_of(gateway)["tandem_admission_pending_tokens"] >= 1010
        finished = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert finished[-1]["choices"][0]["finish_reason"] == "length"


def test_health_is_per_model(stack):
    """Ready only while every model has a live decode worker; the body names the one that has
    none, and the other model keeps serving."""
    r = httpx.get(f"{stack.url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["models"] == {MODEL: "ready", OTHER: "ready"}
    stack.kill("decode-1", signal.SIGKILL)  # the tiny model's only decode worker
    deadline = time.monotonic() + 30
    while (r := httpx.get(f"{stack.url}/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "still ready 30 s after the worker died"
        time.sleep(0.2)
    assert r.status_code == 503
    models = r.json()["models"]
    assert models[MODEL] == "ready"
    assert f"no live decode worker for model {OTHER}" in models[OTHER]
    assert complete(stack, MODEL, [10, 11, 12]).status_code == 200
    stack.restart("decode-1")
    stack.wait_http_ok("/health", time.monotonic() + 60)
