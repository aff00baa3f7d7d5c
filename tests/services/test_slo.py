"""Per-request SLOs: the gateway's defaults, a tenant's, a request's header and body field (what an
OpenAI client's extra_body sends), invalid values as OpenAI-style 400s, and the gRPC request
that carries them to the router (real uvicorn, the official openai client, a scripted backend)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from tandem.v1 import router_pb2

from engine.bundled import DEFAULT_DIR
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from services.gateway.codec import encode_request
from services.gateway.config import GatewayConfig
from services.gateway.core import BackendRequest
from services.gateway.keys import ApiKey, hash_key, load_keys_file
from services.gateway.server import create_app
from services.gateway.slo import Slo, SloOverride, request_slo
from services.router.codec import job_from_pb
from tests.app_server import serving
from tests.services.test_gateway import MODEL, FakeBackend, Gateway, assert_error, openai_client

KEY, FAST_KEY = "sk-plain", "sk-fast"
CONFIG = GatewayConfig(
    model_dir=str(DEFAULT_DIR),
    served_model_name=MODEL,
    max_model_len=512,
    api_keys=(
        ApiKey(hash_key(KEY), "plain"),
        ApiKey(hash_key(FAST_KEY), "fast", slo=SloOverride(ttft_ms=250.0)),
    ),
    default_max_tokens=8,
    slo_ttft_ms=900.0,
    slo_tpot_ms=40.0,
)


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    tok = Tokenizer(DEFAULT_DIR)
    fake = FakeBackend(tok)
    with serving(create_app(CONFIG, fake, tok)) as port:
        url = f"http://127.0.0.1:{port}"
        with openai_client(url, KEY) as client:
            yield Gateway(url, fake, client)


def body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **kw}


def slos(gw: Gateway) -> list[tuple[float, float]]:
    return [(r.slo_ttft_ms, r.slo_tpot_ms) for r in gw.fake.requests]


def test_most_specific_wins_field_by_field() -> None:
    default = Slo(1000, 50)
    assert request_slo(default, None, {}, None, None) == default
    tenant = SloOverride(ttft_ms=300)
    assert request_slo(default, tenant, {}, None, None) == Slo(300, 50)
    headers = {"x-tandem-slo-tpot-ms": "20", "x-tandem-slo-ttft-ms": "400"}
    assert request_slo(default, tenant, headers, None, None) == Slo(400, 20)
    assert request_slo(default, tenant, headers, 150.0, None) == Slo(150, 20)
    assert request_slo(default, tenant, headers, None, 10.0) == Slo(400, 10)


def test_defaults_tenant_header_and_extra_body_reach_the_backend(gw: Gateway) -> None:
    gw.fake.reset()
    gw.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    with openai_client(gw.url, FAST_KEY) as fast:
        fast.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        fast.completions.create(model=MODEL, prompt="Hi", extra_body={"slo_tpot_ms": 12.5})
    gw.client.with_options(default_headers={"x-tandem-slo-ttft-ms": "600"}).completions.create(
        model=MODEL, prompt="Hi", extra_body={"slo_ttft_ms": 350}
    )
    r = gw.post("/v1/chat/completions", body(), key=KEY, headers={"X-Tandem-SLO-TPOT-ms": "15"})
    assert r.status_code == 200, r.text
    assert slos(gw) == [(900, 40), (250, 40), (250, 12.5), (350, 40), (900, 15)]


@pytest.mark.parametrize(
    ("headers", "fields", "param"),
    [
        ({"x-tandem-slo-ttft-ms": "soon"}, {}, "x-tandem-slo-ttft-ms"),
        ({"x-tandem-slo-tpot-ms": "0"}, {}, "x-tandem-slo-tpot-ms"),
        ({"x-tandem-slo-ttft-ms": "nan"}, {}, "x-tandem-slo-ttft-ms"),
        ({}, {"slo_ttft_ms": -5}, "slo_ttft_ms"),
        ({}, {"slo_tpot_ms": 1e12}, "slo_tpot_ms"),
        ({}, {"slo_tpot_ms": "fast"}, "slo_tpot_ms"),
    ],
)
def test_invalid_objectives_are_openai_style_400s(gw: Gateway, headers, fields, param) -> None:
    gw.fake.reset()
    r = gw.post("/v1/chat/completions", body(**fields), key=KEY, headers=headers)
    err = assert_error(r, 400)
    assert param in (err["param"] or "") + err["message"]
    assert gw.fake.requests == []  # refused before any work
    with pytest.raises(openai.BadRequestError):
        gw.client.completions.create(model=MODEL, prompt="Hi", extra_body=fields or
                                     {"slo_ttft_ms": "x"}, extra_headers=headers)  # fmt: skip


def test_keys_file_tenant_objectives(tmp_path) -> None:
    path = tmp_path / "keys.json"
    entry = {"sha256": hash_key("k"), "tenant": "t", "slo_ttft_ms": 500, "slo_tpot_ms": 20}
    path.write_text(json.dumps({"keys": [entry, {"sha256": hash_key("k2")}]}))
    keys = load_keys_file(path)
    assert keys[0].slo == SloOverride(500.0, 20.0) and keys[1].slo == SloOverride()
    path.write_text(json.dumps({"keys": [{**entry, "slo_tpot_ms": -1}]}))
    with pytest.raises(ValueError, match="keys\\[0\\]"):
        load_keys_file(path)


def test_the_grpc_request_carries_them_to_the_routers_job() -> None:
    req = BackendRequest("r1", (5, 6, 7), SamplingParams(max_tokens=4), slo_ttft_ms=300,
                         slo_tpot_ms=25)  # fmt: skip
    pb = router_pb2.GenerateRequest.FromString(encode_request(req).SerializeToString())
    job = job_from_pb(pb, None, "r1", None)  # type: ignore[arg-type]
    assert (job.slo_ttft_ms, job.slo_tpot_ms) == (300, 25)
    assert (job.route.slo_ttft_ms, job.route.slo_tpot_ms) == (300, 25)
    pb.slo.tpot_ms = -1
    with pytest.raises(InvalidRequestError, match="slo.tpot_ms"):
        job_from_pb(pb, None, "r1", None)  # type: ignore[arg-type]
    pb.ClearField("slo")  # an older caller: the router's defaults apply
    assert job_from_pb(pb, None, "r1", None).slo_ttft_ms == 0  # type: ignore[arg-type]
