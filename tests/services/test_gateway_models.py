"""The gateway's /v1/embeddings and LoRA endpoints over a scripted backend (one layer)."""

from __future__ import annotations

import base64
import dataclasses
import struct
from collections.abc import Iterator

import pytest

from services.gateway.server import create_app
from tests.app_server import serving
from tests.services.test_gateway import (
    CONFIG,
    MODEL,
    FakeBackend,
    Gateway,
    assert_error,
    openai_client,
)

# The scripted gateway of tests/services/test_gateway.py (its fixtures: tok, gateway, gw).
pytest_plugins = ["tests.services.test_gateway"]

EMB = "/v1/embeddings"


@pytest.mark.parametrize(
    "value, expect",
    [
        ("Hello there", None),
        (["Hello there", "Bye"], None),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7, 8, 9]], [[5, 6], [7, 8, 9]]),
    ],
    ids=["string", "strings", "token-ids", "token-id-lists"],
)
def test_embeddings_inputs_and_usage(gw: Gateway, tok, value, expect):
    r = gw.post(EMB, {"model": MODEL, "input": value})
    assert r.status_code == 200, r.text
    body = r.json()
    texts = [value] if isinstance(value, str) else value
    ids = expect or [tok.encode(t) for t in texts]
    assert gw.fake.embedded == [(MODEL, ids)]
    assert [d["index"] for d in body["data"]] == list(range(len(ids)))
    assert body["data"][0]["embedding"] == [float(len(ids[0])), 0.5, -0.25]
    n = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert body["model"] == MODEL and body["object"] == "list"


def test_embeddings_base64_is_little_endian_float32(gw: Gateway):
    r = gw.post(EMB, {"model": MODEL, "input": [1, 2], "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert struct.unpack("<3f", raw) == (2.0, 0.5, -0.25)
    # The official client decodes it (it asks for base64 by default).
    out = gw.client.embeddings.create(model=MODEL, input="Hi there")
    assert out.data[0].embedding == [float(len(gw.fake.embedded[-1][1][0])), 0.5, -0.25]


def test_embeddings_bad_input(gw: Gateway):
    for body, param in [
        ({"model": MODEL, "input": ""}, "input"),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": [10**9]}, "input"),
        ({"model": MODEL, "input": "x", "dimensions": 8}, "dimensions"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ]:
        assert_error(gw.post(EMB, body), 400, param)
    r = gw.post(EMB, {"model": "nope", "input": "x"})
    assert assert_error(r, 404)["code"] == "model_not_found"
    assert gw.fake.embedded == []


@pytest.fixture
def lora_gw(tok) -> Iterator[Gateway]:
    config = dataclasses.replace(CONFIG, allow_runtime_lora_updating=True)
    fake = FakeBackend(tok)
    with serving(create_app(config, fake, tok)) as port:
        url = f"http://127.0.0.1:{port}"
        with openai_client(url) as client:
            yield Gateway(url, fake, client)


def test_runtime_lora_updating_is_off_by_default(gw: Gateway):
    body = {"lora_name": "sql", "lora_path": "/a/sql"}
    assert assert_error(gw.post("/v1/load_lora_adapter", body), 403)["type"] == "permission_error"
    assert_error(gw.post("/v1/unload_lora_adapter", {"lora_name": "sql"}), 403)
    assert gw.fake.loras == {}


def test_lora_endpoints_and_models(lora_gw: Gateway):
    gw = lora_gw
    r = gw.post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
    assert r.status_code == 200 and "sql" in r.text
    ids = [m.id for m in gw.client.models.list().data]
    assert ids == [MODEL, "sql"]
    assert gw.client.models.retrieve("sql").model_extra["parent"] == MODEL
    out = gw.client.completions.create(model="sql", prompt="Hi", max_tokens=3)
    assert out.model == "sql" and gw.fake.requests[-1].model == "sql"
    assert_error(gw.post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "x"}), 400)
    assert_error(gw.post("/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "x"}), 400)
    assert_error(gw.post("/v1/load_lora_adapter", {"lora_name": "y"}), 400, "lora_path")
    r = gw.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert r.status_code == 200
    assert_error(gw.post("/v1/unload_lora_adapter", {"lora_name": "sql"}), 404)
    r = gw.post("/v1/completions", {"model": "sql", "prompt": "Hi", "max_tokens": 3})
    assert assert_error(r, 404)["code"] == "model_not_found"


def test_embeddings_spend_the_tenants_token_budget(tok):
    from services.gateway.keys import ApiKey, TenantLimits, hash_key
    from tests.services.test_gateway import KEY

    limits = TenantLimits(tokens_per_window=20, window_seconds=3600)
    config = dataclasses.replace(CONFIG, api_keys=(ApiKey(hash_key(KEY), "t", limits),))
    fake = FakeBackend(tok)
    with serving(create_app(config, fake, tok)) as port:
        gw = Gateway(f"http://127.0.0.1:{port}", fake, None)  # type: ignore[arg-type]
        body = {"model": MODEL, "input": list(range(1, 9))}  # 8 tokens (+1 reserved)
        first = gw.post(EMB, body)
        assert first.status_code == 200 and first.headers["x-ratelimit-limit-tokens"] == "20"
        assert gw.post(EMB, body).status_code == 200  # 16 of 20 spent
        r = gw.post(EMB, body)
        assert assert_error(r, 429)["code"] == "rate_limit_exceeded"
        assert len(fake.embedded) == 2


OTHER = "other"


@pytest.fixture
def two_gw(tok) -> Iterator[Gateway]:
    """Two base models (the second with a context of 64 tokens) over one scripted backend."""
    other = dataclasses.replace(CONFIG, served_model_name=OTHER, max_model_len=64)
    fake = FakeBackend(tok)
    with serving(create_app(CONFIG, fake, tok, extra_models=[(other, tok)])) as port:
        url = f"http://127.0.0.1:{port}"
        with openai_client(url) as client:
            yield Gateway(url, fake, client)


def test_two_models_health_context_and_admission_are_per_model(two_gw: Gateway):
    import httpx

    r = httpx.get(f"{two_gw.url}/health")
    assert r.status_code == 200
    assert r.json()["models"] == {MODEL: "ready", OTHER: "ready"}
    two_gw.fake.unready = {OTHER}
    r = httpx.get(f"{two_gw.url}/health")
    why = f"no live decode worker for model {OTHER}"
    assert r.status_code == 503
    assert r.json() == {"status": "unavailable", "reason": why,
                        "models": {MODEL: "ready", OTHER: why}}  # fmt: skip
    # A prompt of 100 tokens fits the first model's 512, not the other's 64.
    body = {"prompt": list(range(1, 101)), "max_tokens": 4}
    assert two_gw.post("/v1/completions", {**body, "model": MODEL}).status_code == 200
    r = two_gw.post("/v1/completions", {**body, "model": OTHER})
    err = assert_error(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "is 64 tokens" in err["message"]
    assert [q.model for q in two_gw.fake.requests] == [MODEL]
