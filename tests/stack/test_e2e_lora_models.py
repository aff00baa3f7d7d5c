"""Two base models and their adapters behind one endpoint, as ``tandem serve --model A --model B
--lora-modules s=PATH t=PATH`` starts them: real etcd and the services as processes on
loopback, SmolLM2 and a small random Llama (one colocated worker each), an adapter of each.
Each adapter is loaded by its own model's worker only, listed under that model in /v1/models,
and a request to it answers as the engine does with that adapter."""

from __future__ import annotations

import httpx
import pytest

from engine import LLM, SamplingParams
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.conftest import make_random_model_dir
from tests.lora_adapters import ALL_TARGETS, make_adapter
from tests.stack.test_e2e_stack import MODEL

OTHER = "tiny"
PROMPT = "The capital of France is a city that"
MAX_NEW = 8


@pytest.fixture(scope="module")
def folders(smol_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-models")
    other = make_random_model_dir(base, smol_dir, "llama", seed=5)
    return {
        "other": other,
        "s": make_adapter(smol_dir, base / "s", r=8, alpha=16, targets=["q_proj"], seed=1),
        "t": make_adapter(other, base / "t", r=8, alpha=16, targets=ALL_TARGETS, seed=2),
    }


@pytest.fixture(scope="module")
def stack(smol_dir, folders, tmp_path_factory):
    config = StackConfig.colocated(
        1,
        model_dir=str(smol_dir),
        extra_models=(f"{OTHER}={folders['other']}",),
        lora_modules=(f"s={folders['s']}", f"t={folders['t']}"),
        run_dir=str(tmp_path_factory.mktemp("lora-models-stack")),
        port=free_port(),
        member_ttl=3,
        member_refresh=1.0,
    )
    with Stack(config) as s:
        yield s


def complete(stack: Stack, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)


def test_each_adapter_is_served_on_its_own_model(stack, folders):
    r = httpx.get(f"{stack.url}/v1/models", timeout=10)
    assert r.status_code == 200
    listed = {m["id"]: m["parent"] for m in r.json()["data"]}
    assert listed == {MODEL: None, "s": MODEL, OTHER: None, "t": OTHER}
    for worker, adapter in (("decode-0", "s"), ("decode-1", "t")):  # SmolLM2's, the tiny's
        given = [a for a in stack.children[worker].argv if a.startswith("--lora-modules")]
        assert given == [f"--lora-modules={adapter}={folders[adapter]}"]

    llm = LLM(folders["other"], enable_lora=True, num_kv_blocks=64)
    llm.engine.add_lora("t", str(folders["t"]))
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    (want,) = llm.generate([ids], params, lora="t")
    (base,) = llm.generate([ids], params)
    assert want.token_ids != base.token_ids  # the adapter changes the answer
    r = complete(stack, "t", ids)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "t"
    assert r.json()["choices"][0]["text"] == llm.tokenizer.decode(want.token_ids)
    r = complete(stack, "s", ids)  # SmolLM2's adapter, on SmolLM2's worker
    assert r.status_code == 200 and r.json()["model"] == "s", r.text
