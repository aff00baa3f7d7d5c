"""The gateway's protection in isolation: hashed API keys, per-tenant token and request rate
limits with their headers and settlement, gateway admission, and deadlines (a stand-in router
over real gRPC; the whole stack is covered in test_e2e_protection)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.bundled import DEFAULT_DIR
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from services.gateway import keys as keys_mod
from services.gateway.config import GatewayConfig
from services.gateway.core import APIError, BackendRequest
from services.gateway.grpc_backend import GrpcBackend
from services.gateway.keys import ApiKey, KeyRing, TenantLimits, hash_key, load_keys_file
from services.gateway.limits import Limits, Overloaded, _duration
from services.gateway.server import create_app
from tests.app_server import serving
from tests.services.test_gateway import MODEL, FakeBackend
from tests.services.test_gateway_grpc import make_request, router  # noqa: F401 - fixture


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def req(rid: str, prompt: int, max_tokens: int, tenant: str = "acme", **kw) -> BackendRequest:
    return BackendRequest(rid, tuple(range(prompt)), SamplingParams(max_tokens=max_tokens),
                          tenant, **kw)  # fmt: skip


# --- keys ----------------------------------------------------------------------------------------


def test_keys_file_holds_only_hashes_and_lookup_matches(tmp_path: Path, capsys) -> None:
    keys_mod.main(["sk-alpha", "--tenant", "acme", "--tokens-per-window", "500"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["sha256"] == hash_key("sk-alpha") and "sk-alpha" not in json.dumps(printed)
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [printed, keys_mod.entry("sk-beta")]}))
    loaded = load_keys_file(path)
    assert loaded[0] == ApiKey(hash_key("sk-alpha"), "acme", TenantLimits(500, 0, 60.0))
    assert loaded[1].tenant == "t-" + hash_key("sk-beta")[:12] and not loaded[1].limits.limited
    ring = KeyRing(loaded)
    assert ring.find("sk-alpha") is loaded[0] and ring.find("sk-beta") is loaded[1]
    assert ring.find("sk-alph") is None and ring.find("") is None
    assert not KeyRing(())


@pytest.mark.parametrize(
    "content",
    ['{"keys": [{"sha256": "abc"}]}', '{"keys": [{"tenant": "x"}]}', "[]",
     '{"keys": [{"sha256": "' + "0" * 64 + '", "window_seconds": 0}]}'],
)  # fmt: skip
def test_bad_keys_files_are_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ValueError):
        load_keys_file(path)


# --- rate limits ---------------------------------------------------------------------------------


def limits(clock: Clock, tokens: int = 100, requests: int = 3, inflight: int = 0) -> Limits:
    return Limits({"acme": TenantLimits(tokens, requests, 10.0)}, inflight, 0.5, clock=clock)


def test_reserve_then_settle_what_was_really_generated() -> None:
    clock = Clock()
    lim = limits(clock)
    t = lim.admit(req("a", 10, 40))  # reserves 50 tokens and 1 request
    assert t.headers == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "3.334s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "50",
        "x-ratelimit-reset-tokens": "5s",
    }
    t.settle(5)  # 10 prompt + 5 generated used; 35 come back
    t.settle(5)  # once only
    t2 = lim.admit(req("b", 10, 10))
    assert t2.headers["x-ratelimit-remaining-tokens"] == str(100 - 15 - 20)
    t2.settle(0)  # nothing generated (failed before the first token): nothing charged
    assert lim.admit(req("c", 1, 1)).headers["x-ratelimit-remaining-tokens"] == str(100 - 15 - 2)
    assert lim.admit(req("free", 10**6, 1, tenant="other")).headers == {}  # no limits


def test_over_the_token_budget_is_a_429_with_retry_after() -> None:
    clock = Clock()
    lim = limits(clock, requests=0)
    lim.admit(req("a", 10, 80))  # 10 left
    with pytest.raises(APIError) as e:
        lim.admit(req("b", 10, 20))  # needs 30: 20 more at 10 tokens/s = 2 s
    err = e.value
    assert (err.status, err.type, err.code) == (429, "tokens", "rate_limit_exceeded")
    assert err.headers["Retry-After"] == "2" and err.headers["retry-after-ms"] == "2000"
    assert err.headers["x-ratelimit-remaining-tokens"] == "10"
    assert "try again in 2s" in err.message
    clock.now += 2.0
    lim.admit(req("b", 10, 20))  # refilled


def test_a_request_larger_than_the_budget_waits_for_a_full_bucket() -> None:
    clock = Clock()
    lim = limits(clock, requests=0)
    t = lim.admit(req("big", 50, 4000))  # reserves the whole bucket, not more
    assert t.reserved == 100
    t.settle(90)  # used 140: a debt of 40, paid back by refill
    with pytest.raises(APIError) as e:
        lim.admit(req("next", 1, 1))
    assert e.value.headers["retry-after-ms"] == "4200"


def test_request_limit_and_no_partial_reservation() -> None:
    clock = Clock()
    lim = limits(clock, tokens=100, requests=1)
    lim.admit(req("a", 1, 1))
    with pytest.raises(APIError) as e:
        lim.admit(req("b", 1, 1))
    assert e.value.type == "requests" and e.value.headers["x-ratelimit-remaining-requests"] == "0"
    lim2 = limits(clock, tokens=10, requests=5)
    lim2.admit(req("x", 2, 3))  # 5 tokens left
    with pytest.raises(APIError):
        lim2.admit(req("c", 10, 10))  # 10 > 5 left: tokens refuse...
    t = lim2.admit(req("d", 1, 1))  # ...and the request slot it took was given back
    assert t.headers["x-ratelimit-remaining-requests"] == "3"


def test_gateway_admission_sheds_batch_first_and_releases_on_settle() -> None:
    lim = limits(Clock(), tokens=0, requests=0, inflight=100)
    t = lim.admit(req("i", 30, 30))
    with pytest.raises(APIError) as e:
        lim.admit(req("b", 1, 1, priority="batch"))  # 62 > 50
    assert (e.value.status, e.value.code) == (429, "server_overloaded")
    assert e.value.headers["Retry-After"] == "1"
    lim.admit(req("i2", 20, 20))  # interactive fits up to 100
    t.settle(3)
    lim.admit(req("b", 1, 1, priority="batch"))


def test_durations_in_openai_format() -> None:
    assert [_duration(s) for s in (0.02, 1.5, 59.9991, 360.0)] == ["20ms", "1.5s", "60s", "6m0s"]


# --- over HTTP (stand-in backend) ----------------------------------------------------------------

KEY = "sk-limited"
CONFIG = GatewayConfig(
    model_dir=str(DEFAULT_DIR),
    served_model_name=MODEL,
    max_model_len=512,
    api_keys=(ApiKey(hash_key(KEY), "acme", TenantLimits(300, 100, 1e6)),),
    default_max_tokens=50,
    max_request_timeout=5.0,
)


@pytest.fixture(scope="module")
def app_url() -> Iterator[tuple[str, FakeBackend]]:
    tok = Tokenizer(DEFAULT_DIR)
    fake = FakeBackend(tok)
    with serving(create_app(CONFIG, fake, tok)) as port:
        yield f"http://127.0.0.1:{port}", fake


def post(url: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=10)  # fmt: skip


def test_usage_charged_matches_what_was_streamed(app_url) -> None:
    url, fake = app_url
    body = {"prompt": "Hi", "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    r = post(url, body)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-tokens"] == "300"
    before = int(r.headers["x-ratelimit-remaining-tokens"])  # after reserving prompt + 40
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(fake.reply_ids())
    r2 = post(url, {"prompt": "Hi", "max_tokens": 1})
    assert r2.status_code == 200
    # The first request's unused reservation came back; the second reserved prompt + 1.
    expected = before + 40 - usage["completion_tokens"] - (usage["prompt_tokens"] + 1)
    assert abs(int(r2.headers["x-ratelimit-remaining-tokens"]) - expected) <= 1
    r3 = post(url, {"prompt": "Hi", "max_tokens": 290})
    assert r3.status_code == 429 and r3.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(r3.headers["Retry-After"]) >= 1 and "x-ratelimit-reset-tokens" in r3.headers


def test_timeout_field_is_checked_and_priority_carried(app_url) -> None:
    url, fake = app_url
    fake.reset()
    assert post(url, {"prompt": "Hi", "max_tokens": 1, "timeout": 0}).status_code == 400
    assert post(url, {"prompt": "Hi", "max_tokens": 1, "priority": "urgent"}).status_code == 400
    r = post(url, {"prompt": "Hi", "max_tokens": 1, "timeout": 999, "priority": "batch"})
    assert r.status_code == 200
    sent = fake.requests[-1]
    assert sent.priority == "batch"
    assert sent.time_left() is not None and sent.time_left() <= 5.0  # capped by the server


async def test_deadline_passes_as_grpc_deadline_and_gives_504(router) -> None:  # noqa: F811
    fake, address = router
    fake.mode = "hang"  # three tokens, then nothing
    backend = GrpcBackend([address])
    request = dataclasses.replace(make_request(), deadline=time.monotonic() + 0.5)
    got, t0 = [], time.monotonic()
    with pytest.raises(APIError) as e:
        async for ev in backend.generate(request):
            got.append(ev)
    assert (e.value.status, e.value.code) == (504, "timeout") and len(got) == 3
    assert time.monotonic() - t0 < 3
    await fake.cancelled.wait()  # the router side saw the call end
    await backend.close()


def test_gateway_admission_is_per_base_model() -> None:
    """Each base model has its own ledger: one model at its bound refuses its own requests
    (named in the 429) and not another's; settling returns the tokens to the right one."""
    lim = Limits({}, 100, 0.5, clock=Clock(), models=("a", "b"))
    hog = lim.admit(req("hog", 10, 80), "a")  # 90 of a's 100
    with pytest.raises(APIError) as e:
        lim.admit(req("a2", 10, 10), "a")
    assert (e.value.status, e.value.code) == (429, "server_overloaded")
    assert "model a" in e.value.message
    lim.admit(req("b1", 10, 80), "b").settle(3)  # b is empty: admitted
    assert lim.ledgers["b"].pending_tokens == 0 and lim.ledgers["a"].pending_tokens == 90
    lim.admit(req("first", 1, 1))  # no model named: the first one's ledger
    assert lim.ledgers["a"].pending_tokens == 92
    hog.settle(5)
    lim.admit(req("a3", 10, 10), "a")


# --- the routers' refusals for capacity, remembered (issue 18: fast 429s) ----------------------


def test_a_refusal_from_the_routers_refuses_larger_requests_here_for_a_while() -> None:
    clock = Clock()
    lim = Limits({}, 0, clock=clock, models=("a", "b"), refusal_memory=1.0)
    lim.refused("a", req("r", 10, 20, model="a"), Overloaded("full", 400, room_tokens=30))
    with pytest.raises(Overloaded) as e:
        lim.admit(req("big", 10, 25, model="a"), "a")  # 35 > 30
    assert (e.value.status, e.value.code) == (429, "server_overloaded")
    assert e.value.headers["retry-after-ms"] == "400" and e.value.headers["Retry-After"] == "1"
    lim.admit(req("fits", 10, 20, model="a"), "a").settle(0)  # the routers decide
    lim.admit(req("other", 10, 25, model="b"), "b").settle(0)  # another base model
    lim.admit(req("lora", 10, 25, model="a-adapter"), "a").settle(0)  # another model name
    lim.admit(req("batch", 10, 25, model="a", priority="batch"), "a").settle(0)
    with pytest.raises(Overloaded):
        lim.check_room("a", "a", "interactive", 31)  # before tokenizing: a lower bound
    lim.released("a", req("done", 2, 3))  # a request a worker took ended: 5 more room
    lim.check_room("a", "a", "interactive", 35)
    clock.now += 0.4  # the routers' Retry-After is over: they are asked again
    lim.admit(req("big2", 10, 90, model="a"), "a").settle(0)
    lim.refused("a", req("r", 10, 20, model="a"), Overloaded("full", None, room_tokens=0))
    with pytest.raises(Overloaded):
        lim.check_room("a", "a", "interactive", 1)
    clock.now += 1.0  # no Retry-After from the routers: remembered refusal_memory seconds
    lim.check_room("a", "a", "interactive", 1)
    off = Limits({}, 0, clock=clock, refusal_memory=0.0)
    off.refused("", req("r", 10, 20), Overloaded("full", 400, room_tokens=0))
    off.check_room("", "", "interactive", 10**6)


def test_the_429_of_a_full_stack_carries_the_room_the_router_said() -> None:
    import grpc

    from services.gateway import codec

    trailers = [("retry-after-ms", "250"), ("room-tokens", "42")]
    err = codec.http_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", trailers)
    assert isinstance(err, Overloaded) and err.room_tokens == 42 and err.retry_after_ms == 250
    assert err.headers == {"Retry-After": "1", "retry-after-ms": "250"}
    err = codec.http_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
    assert isinstance(err, Overloaded) and err.room_tokens is None


def test_the_fewest_tokens_a_request_can_book_before_its_prompt_is_known() -> None:
    from services.gateway.prepare import _least_cost
    from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

    assert _least_cost(CompletionRequest(model=MODEL, prompt="x", max_tokens=16), 1) == 17
    assert _least_cost(CompletionRequest(model=MODEL, prompt="x", max_tokens=16), 3) == 49
    assert _least_cost(CompletionRequest(model=MODEL, prompt="x"), 2) == 3  # default: >= 1 each
    chat = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                 max_tokens=5, max_completion_tokens=9)  # fmt: skip
    assert _least_cost(chat, 1) == 10


MEMORY_CONFIG = dataclasses.replace(CONFIG, api_keys=(), refusal_memory=5.0)


def test_a_full_stack_answers_429_before_tokenizing_or_calling_the_router() -> None:
    """After the routers' 429 (room 50 tokens), a request that cannot fit whatever its prompt is
    refused before its prompt is tokenized and without a call; one that fits is sent; the end
    of a request a worker took gives its tokens back to the room."""
    tok = Tokenizer(DEFAULT_DIR)
    fake = FakeBackend(tok)
    encoded: list[str] = []
    encode = tok.encode
    tok.encode = lambda text, *a, **kw: encoded.append(text) or encode(text, *a, **kw)  # type: ignore[method-assign]
    with serving(create_app(MEMORY_CONFIG, fake, tok)) as port:
        url = f"http://127.0.0.1:{port}"
        fake.fail = Overloaded("every worker is at capacity", 3000, room_tokens=50)
        r = post(url, {"prompt": "Hi there", "max_tokens": 40})
        assert r.status_code == 429 and len(fake.requests) == 1
        r = post(url, {"prompt": "Hello world", "max_tokens": 60})  # at least 61 > 50
        assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
        assert int(r.headers["retry-after-ms"]) <= 3000 and r.headers["Retry-After"] == "3"
        assert len(fake.requests) == 1 and "Hello world" not in encoded
        r = post(url, {"prompt": "Hello world", "max_tokens": 49})  # 50 <= 50, but 2 + 49 > 50
        assert r.status_code == 429 and len(fake.requests) == 1 and "Hello world" in encoded
        fake.fail = None
        r = post(url, {"prompt": "Hi", "max_tokens": 40})  # fits: the router is asked
        assert r.status_code == 200 and len(fake.requests) == 2
        # It ended: its prompt and 40 tokens are free again, so 60 more now fit.
        r = post(url, {"prompt": "Hello world", "max_tokens": 60})
        assert r.status_code == 200 and len(fake.requests) == 3


def test_requests_are_tokenized_a_few_at_a_time_in_arrival_order() -> None:
    """``--tokenizer-threads``: under a burst the gateway prepares a request or two at once
    instead of all of them together, so each reaches its router (or its 429) soon."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    tok = Tokenizer(DEFAULT_DIR)
    fake = FakeBackend(tok)
    busy, most, lock = [0], [0], threading.Lock()
    encode = tok.encode_prompt  # the gateway's tokenizing (the fake backend's own encode not)

    def slow_encode(text, *a, **kw):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        time.sleep(0.05)
        with lock:
            busy[0] -= 1
        return encode(text, *a, **kw)

    tok.encode_prompt = slow_encode  # type: ignore[method-assign]
    config = dataclasses.replace(MEMORY_CONFIG, tokenizer_threads=2)
    with serving(create_app(config, fake, tok)) as port:
        url = f"http://127.0.0.1:{port}"
        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(lambda i: post(url, {"prompt": f"Hi {i}", "max_tokens": 2})
                                  .status_code, range(6)))  # fmt: skip
    assert codes == [200] * 6 and most[0] == 2
    with pytest.raises(ValueError, match="--tokenizer-threads >= 1"):
        dataclasses.replace(MEMORY_CONFIG, tokenizer_threads=0)
