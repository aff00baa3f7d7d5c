"""Multi-LoRA end to end: real etcd and the services as processes on loopback (one prefill, one
decode worker, every prompt handed off between them), SmolLM2 with peft-made adapters.

Greedy output through the stack equals the engine's with the same adapter (which equals
transformers+peft, tests/engine/test_lora.py), for base and adapter requests running together;
adapters
load and unload at run time through the gateway (vLLM's endpoints), and are recorded in etcd,
so workers the supervisor restarts load them again (and not once unloaded); bad input gets
400/404.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from libkv.cluster.adapters import AdapterRecords
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.lora_adapters import ALL_TARGETS, make_adapter
from tests.stack.test_e2e_stack import MODEL
from tests.stack_probe import worker_stats

MAX_NEW = 10
PROMPTS = [
    "The capital of France is a city that",
    "def fibonacci(n):\n    # return the n-th number",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
LORA_FLAGS = ("--max-lora-rank=16", "--max-loras=2")


@pytest.fixture(scope="module")
def adapters(smol_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e-adapters")
    return {
        "a": make_adapter(smol_dir, base / "a", r=8, alpha=16, targets=ALL_TARGETS, seed=1),
        "b": make_adapter(
            smol_dir, base / "b", r=16, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
            seed=2, rslora=True,
        ),
        "big": make_adapter(smol_dir, base / "big", r=32, alpha=8, targets=["q_proj"], seed=3),
    }  # fmt: skip


@pytest.fixture(scope="module")
def expected(smol_dir, adapters):
    """The engine's greedy tokens per (prompt, adapter)."""
    llm = LLM(smol_dir, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=256)
    for name in ("a", "b"):
        llm.engine.add_lora(name, str(adapters[name]))
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    out = {}
    for name in (None, "a", "b"):
        for p, o in zip(PROMPTS, llm.generate(ids, params, lora=name), strict=True):
            out[(p, name)] = o.token_ids
    vectors = {name: llm.engine.embed(ids[0], lora=name).tolist() for name in (None, "a")}
    return {"ids": dict(zip(PROMPTS, ids, strict=True)), "tokens": out, "embed": vectors}


@pytest.fixture(scope="module")
def stack(smol_dir, adapters, tmp_path_factory):
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path_factory.mktemp("lora")),
        port=free_port(),
        num_prefill=1,
        num_decode=1,
        decode_only_threshold=4,  # every prompt here goes prefill -> hand-off -> decode
        disagg_mode="length",  # placement by length alone, whatever the load
        member_ttl=3,
        member_refresh=1.0,
        worker_args=(f"--lora-modules=a={adapters['a']}", *LORA_FLAGS),
        gateway_args=("--allow-runtime-lora-updating",),
    )
    with Stack(config) as s:
        yield s


def complete(stack: Stack, model: str, prompt: list[int]) -> httpx.Response:
    body = {
        "model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
        "ignore_eos": True, "logprobs": 0,
    }  # fmt: skip
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)


def tokens_of(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def run_mixed(stack: Stack, expected, names: list[str | None]) -> None:
    """Every prompt under every adapter of ``names`` at once; each equals the engine's."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(stack.config.model_dir)
    jobs = [(p, n) for p in PROMPTS for n in names]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {
            job: pool.submit(complete, stack, job[1] or MODEL, expected["ids"][job[0]])
            for job in jobs
        }
        for (p, n), fut in futures.items():
            want = [tok.decode([t]) for t in expected["tokens"][(p, n)]]
            assert tokens_of(fut.result()) == want, (p, n)


def models(stack: Stack) -> dict[str, dict]:
    r = httpx.get(f"{stack.url}/v1/models", timeout=10)
    assert r.status_code == 200
    return {m["id"]: m for m in r.json()["data"]}


def post(stack: Stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", content=json.dumps(body), timeout=120)


def test_start_time_adapter_through_the_handoff(stack, expected):
    listed = models(stack)
    assert set(listed) == {MODEL, "a"} and listed["a"]["parent"] == MODEL
    run_mixed(stack, expected, [None, "a"])
    # Disaggregated: the prefill worker computed every prompt, the decode worker none of them.
    stats = worker_stats(stack)
    prompt_tokens = sum(len(expected["ids"][p]) for p in PROMPTS)
    assert stats["prefill-0"].prompt_tokens >= 2 * prompt_tokens
    assert stats["decode-0"].prompt_tokens == 0


def test_load_and_unload_at_run_time(stack, expected, adapters):
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert r.status_code == 200, r.text
    assert set(models(stack)) == {MODEL, "a", "b"}
    run_mixed(stack, expected, [None, "a", "b"])
    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200, r.text
    assert set(models(stack)) == {MODEL, "a"}
    r = complete(stack, "b", expected["ids"][PROMPTS[0]])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_bad_adapters_and_unknown_models(stack, adapters, tmp_path):
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, "not a directory"),
        ({"lora_name": "big", "lora_path": str(adapters["big"])}, "over the limit of 16"),
        ({"lora_name": "a", "lora_path": str(adapters["a"])}, "already loaded"),
    ]
    for body, reason in cases:
        r = post(stack, "/v1/load_lora_adapter", body)
        assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    assert set(models(stack)) == {MODEL, "a"}  # nothing half-loaded
    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "zzz"})
    assert r.status_code == 404, r.text
    r = complete(stack, "zzz", [1, 2, 3])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{stack.url}/v1/models/zzz", timeout=10).status_code == 404
    assert httpx.get(f"{stack.url}/v1/models/a", timeout=10).json()["parent"] == MODEL


def test_embeddings_of_base_and_adapter(stack, expected):
    import openai

    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    for name in (None, "a"):
        out = client.embeddings.create(model=name or MODEL, input=[PROMPTS[0], PROMPTS[1]])
        assert out.usage.prompt_tokens == sum(len(expected["ids"][p]) for p in PROMPTS[:2])
        got = torch.tensor(out.data[0].embedding)
        want = torch.tensor(expected["embed"][name])
        assert torch.nn.functional.cosine_similarity(got, want, dim=0).item() > 0.9999
    base = client.embeddings.create(model=MODEL, input=PROMPTS[0]).data[0].embedding
    assert base != client.embeddings.create(model="a", input=PROMPTS[0]).data[0].embedding


def recorded(stack: Stack) -> dict[str, str]:
    """The run-time adapters etcd records for the model (``libkv.cluster.adapters``)."""

    async def read() -> dict[str, str]:
        records = AdapterRecords(stack.etcd.endpoint)
        try:
            return await records.list(MODEL)
        finally:
            await records.close()

    return asyncio.run(read())


def crash_and_heal(stack: Stack, names: tuple[str, ...]) -> None:
    """kill -9 the workers ``names``; the supervisor starts them again; wait until each
    printed READY."""
    said: list[str] = []
    sup = stack.supervisor(say=said.append)
    for name in names:
        stack.kill(name)
    deadline = time.monotonic() + 180
    while not all(f"{n} is serving again" in " ".join(said) for n in names):
        assert time.monotonic() < deadline, said
        sup.poll()
        time.sleep(0.2)


def wait_listed(stack: Stack, want: set[str]) -> None:
    deadline = time.monotonic() + 30
    while set(models(stack)) != want:
        assert time.monotonic() < deadline, models(stack)
        time.sleep(0.2)


@pytest.mark.slow
def test_run_time_adapters_survive_worker_restarts(stack, expected, adapters):
    """A run-time load is recorded in etcd: both workers killed with -9 and restarted by the
    supervisor load it before they register, so it still answers token for token as before and
    is listed; once unloaded, its record is gone and a restarted worker does not load it."""
    assert recorded(stack) == {}  # the loads refused earlier left no record
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert r.status_code == 200, r.text
    assert recorded(stack) == {"b": str(adapters["b"])}
    prompt = expected["ids"][PROMPTS[1]]
    before = tokens_of(complete(stack, "b", prompt))
    prefilled = worker_stats(stack)["prefill-0"].prompt_tokens

    crash_and_heal(stack, ("prefill-0", "decode-0"))
    wait_listed(stack, {MODEL, "a", "b"})
    assert tokens_of(complete(stack, "b", prompt)) == before
    # The restarted prefill worker holds b too: it prefilled the prompt (not decode-only).
    assert worker_stats(stack)["prefill-0"].prompt_tokens == len(prompt) < prefilled
    run_mixed(stack, expected, [None, "a", "b"])

    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200, r.text
    assert recorded(stack) == {}
    crash_and_heal(stack, ("decode-0",))
    wait_listed(stack, {MODEL, "a"})  # a comes from --lora-modules
    r = complete(stack, "b", prompt)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    log = stack.children["decode-0"].log_path.read_text()
    assert "loaded recorded LoRA adapter b" in log  # the first restart's
    assert "loaded recorded LoRA adapter b" not in log.rsplit("restarted by the supervisor", 1)[1]


@pytest.mark.slow
def test_adapters_on_tensor_parallel_workers(smol_dir, adapters, expected, tmp_path):
    """Prefill at TP=1 hands off to decode at TP=2, both with a start-time adapter and one
    loaded at run time (reaching rank 1 of the decode worker too): base and both adapters
    mixed answer as the TP=1 engine does."""
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path / "tp"),
        port=free_port(),
        decode_tp=2,
        decode_only_threshold=4,
        disagg_mode="length",
        member_ttl=3,
        member_refresh=1.0,
        start_timeout=300.0,
        worker_args=(f"--lora-modules=a={adapters['a']}", *LORA_FLAGS),
        gateway_args=("--allow-runtime-lora-updating",),
    )
    with Stack(config) as s:
        r = post(s, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
        assert r.status_code == 200, r.text
        run_mixed(s, expected, [None, "a", "b"])
        assert worker_stats(s)["decode-0"].prompt_tokens == 0  # every prompt was handed off
