"""The HTTP gateway as a unit: real uvicorn on loopback, the official openai client, the bundled
model's tokenizer, and a scripted FakeBackend in place of the router (end-to-end tests with the
real router live elsewhere)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from engine.bundled import DEFAULT_DIR
from engine.tokenizer import Tokenizer
from services.gateway.config import GatewayConfig
from services.gateway.core import (
    APIError,
    BackendEvent,
    BackendRequest,
    TokenLogprob,
    Usage,
)
from services.gateway.keys import ApiKey, hash_key, tenant_of_hash
from services.gateway.prepare import prepare_chat, prepare_completion
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.server import create_app
from tests.app_server import serving
from tests.conftest import BOS_ID, make_bos_model_dir

MODEL = "smol"
KEY, TENANT = "sk-test-key", "acme"
CONFIG = GatewayConfig(
    model_dir=str(DEFAULT_DIR),
    served_model_name=MODEL,
    max_model_len=512,
    api_keys=(ApiKey(hash_key(KEY), TENANT),),
    max_body_bytes=64 * 1024,
    default_max_tokens=100,
)
REPLY = "Hello world! How are you?"
CACHED = 3
ERROR_KEYS = {"message", "type", "param", "code"}


class FakeBackend:
    """Scripted Backend: replies ``reply`` (REPLY by default) one token per event, to each of the
    request's ``n`` choices in turn; can fail, hang, or report unhealthy. Lives on the server's
    event loop; tests read what it recorded from their own thread."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.reset()

    def reset(self) -> None:
        self.requests: list[BackendRequest] = []
        self.aborted: list[str] = []
        self.abort_called = threading.Event()
        self.fail: APIError | None = None
        self.hang_after: int | None = None  # hang forever after this many events
        self.is_healthy = True
        self.unready: set[str] = set()  # base models with no live decode worker
        self.reply = REPLY
        self.loras: dict[str, str] = {}
        self.embedded: list[tuple[str, list[list[int]]]] = []
        self.scored: list[tuple[str, list[list[int]], int]] = []

    def reply_ids(self) -> list[int]:
        return self.tok.encode(self.reply)

    async def generate(self, req: BackendRequest) -> AsyncIterator[BackendEvent]:
        self.requests.append(req)
        if self.fail is not None:
            raise self.fail
        ids = self.reply_ids()
        k = req.sampling.logprobs
        for i, t in enumerate(ids):
            if self.hang_after is not None and i >= self.hang_after:
                await asyncio.sleep(3600)
            last = i == len(ids) - 1
            for index in range(req.sampling.n):
                lps = ()
                if k is not None:  # the chosen token first, then made-up alternatives
                    lp = -0.25 * (index + 1)  # later choices are less likely (best_of)
                    top = ((t, lp), *((100 + j, -2.0 - j) for j in range(k)))[:k]
                    lps = (TokenLogprob(t, lp, top),)
                yield BackendEvent(
                    token_ids=(t,),
                    text=self.tok.decode([t]),
                    logprobs=lps,
                    finish_reason="stop" if last else None,
                    usage=Usage(len(req.token_ids), len(ids), CACHED) if last else None,
                    index=index,
                )
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.abort_called.set()

    async def readiness(self, model: str = "") -> str | None:
        if model in self.unready:
            return f"no live decode worker for model {model}"
        return None if self.is_healthy else "no live decode worker"

    async def adapters(self) -> dict[str, str]:
        return {name: MODEL for name in self.loras}

    async def load_lora(self, name: str, path: str) -> None:
        if name in self.loras:
            raise APIError(400, f"the adapter `{name}` is already loaded")
        self.loras[name] = path

    async def unload_lora(self, name: str) -> None:
        if self.loras.pop(name, None) is None:
            raise APIError(404, f"the adapter `{name}` is not loaded")

    async def embed(
        self, request_id: str, model: str, inputs: list[list[int]]
    ) -> tuple[list[list[float]], int]:
        self.embedded.append((model, inputs))
        return [[float(len(ids)), 0.5, -0.25] for ids in inputs], sum(map(len, inputs))

    async def prompt_logprobs(
        self, request_id: str, model: str, inputs: list[list[int]], k: int
    ) -> tuple[list[list[TokenLogprob]], int]:
        """Made-up scores: token i of a prompt (i >= 1) gets -i/10 and rank i, and ``k``
        alternatives 300, 301, ..."""
        self.scored.append((model, inputs, k))
        if self.fail is not None:
            raise self.fail
        out = [
            [
                TokenLogprob(t, -i / 10, tuple((300 + j, -0.01 * j) for j in range(k)), i)
                for i, t in enumerate(ids[1:], start=1)
            ]
            for ids in inputs
        ]
        return out, sum(map(len, inputs))


AUTH = {"Authorization": f"Bearer {KEY}"}
USER_HI = [{"role": "user", "content": "Hi"}]


def openai_client(url: str, api_key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


@dataclass
class Gateway:
    url: str
    fake: FakeBackend
    client: openai.OpenAI

    def post(
        self, path: str, body: object = None, *, key: str | None = KEY, **kw
    ) -> httpx.Response:
        headers = kw.pop("headers", {})
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        if body is not None:
            kw["content"] = body if isinstance(body, (bytes, str)) else json.dumps(body)
            headers.setdefault("Content-Type", "application/json")
        kw.setdefault("timeout", 10)
        return httpx.post(f"{self.url}{path}", headers=headers, **kw)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEFAULT_DIR)


@pytest.fixture(scope="module")
def gateway(tok: Tokenizer) -> Iterator[Gateway]:
    fake = FakeBackend(tok)
    with serving(create_app(CONFIG, fake, tok)) as port:
        url = f"http://127.0.0.1:{port}"
        with openai_client(url) as client:
            yield Gateway(url, fake, client)


@pytest.fixture
def gw(gateway: Gateway) -> Gateway:
    gateway.fake.reset()
    return gateway


def chat_body(content: str = "Hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers.get("x-request-id")
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# --- Happy paths --------------------------------------------------------------------------------


def test_chat_completion(gw: Gateway, tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    raw = gw.client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        seed=7,
        stop=["\n", "END"],
        temperature=0.5,
        top_p=0.9,
        max_tokens=50,
        logprobs=True,
        top_logprobs=2,
        user="u1",
        extra_body={"top_k": 40, "repetition_penalty": 1.1, "some_future_field": 1},
    )
    resp = raw.parse()
    [req] = gw.fake.requests
    n_reply = len(gw.fake.reply_ids())
    assert raw.headers["x-request-id"] == resp.id == req.request_id
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.model == MODEL
    assert resp.choices[0].message.content == REPLY
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "stop"
    assert list(req.token_ids) == tok.encode_chat(messages)
    assert resp.usage.prompt_tokens == len(tok.encode_chat(messages))
    assert resp.usage.completion_tokens == n_reply
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + n_reply
    assert resp.usage.prompt_tokens_details.cached_tokens == CACHED
    s = req.sampling
    assert (s.seed, s.stop, s.temperature, s.top_p) == (7, ("\n", "END"), 0.5, 0.9)
    assert s.max_tokens == 50
    assert (s.top_k, s.repetition_penalty, s.logprobs) == (40, 1.1, 2)
    assert (req.tenant, req.model) == (TENANT, MODEL)
    content = resp.choices[0].logprobs.content
    assert "".join(c.token for c in content) == REPLY
    assert all(c.logprob == -0.25 and len(c.top_logprobs) == 2 for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    assert content[0].top_logprobs[0].token == content[0].token


def test_chat_streaming_with_usage(gw: Gateway, tok: Tokenizer) -> None:
    stream = gw.client.chat.completions.create(
        model=MODEL,
        messages=USER_HI,
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=30,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    prompt_len = len(tok.encode_chat([{"role": "user", "content": "Hi"}]))
    assert last.usage.prompt_tokens == prompt_len
    assert last.usage.completion_tokens == len(gw.fake.reply_ids())
    assert last.usage.total_tokens == prompt_len + len(gw.fake.reply_ids())
    assert gw.fake.requests[0].sampling.max_tokens == 30
    assert gw.fake.aborted == []


def test_raw_sse_framing(gw: Gateway) -> None:
    body = {"model": MODEL, "prompt": "Hi", "stream": True}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("cmpl-")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert "usage" not in json.loads(events[0][6:])


@pytest.mark.parametrize("prompt", ["Say hi", ["Say hi"], "ids"])
def test_completion(gw: Gateway, tok: Tokenizer, prompt) -> None:
    ids = tok.encode("Say hi")
    resp = gw.client.completions.create(
        model=MODEL, prompt=ids if prompt == "ids" else prompt, logprobs=2, seed=3, stop="x"
    )
    [req] = gw.fake.requests
    assert list(req.token_ids) == ids
    assert (req.sampling.seed, req.sampling.stop, req.sampling.logprobs) == (3, ("x",), 2)
    assert req.sampling.max_tokens == CONFIG.default_max_tokens  # omitted: min(room, default)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    choice = resp.choices[0]
    assert choice.text == REPLY and choice.finish_reason == "stop"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(gw.fake.reply_ids())
    lp = choice.logprobs
    assert "".join(lp.tokens) == REPLY
    assert lp.token_logprobs == [-0.25] * len(lp.tokens)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_completion_batch_of_prompts(gw: Gateway, tok: Tokenizer, kind) -> None:
    """OpenAI's and vLLM's batch: ``prompt`` as a list of strings or of token-id lists. One
    backend request per prompt, choices numbered prompt after prompt, usage summed (it was a
    400: "a list of strings must hold exactly one")."""
    texts = ["Say hi", "Bye now", "x"]
    ids = [tok.encode(t) for t in texts]
    resp = gw.client.completions.create(
        model=MODEL, prompt=texts if kind == "text" else ids, n=2, max_tokens=20, seed=5
    )
    by_id = {r.request_id: r for r in gw.fake.requests}
    assert sorted(by_id) == [f"{resp.id}-{i}" for i in range(3)]
    assert [list(by_id[f"{resp.id}-{i}"].token_ids) for i in range(3)] == ids
    assert all(r.sampling.n == 2 and r.sampling.seed == 5 for r in by_id.values())
    assert [c.index for c in resp.choices] == list(range(6))
    assert all(c.text == REPLY and c.finish_reason == "stop" for c in resp.choices)
    assert resp.usage.prompt_tokens == sum(map(len, ids))
    assert resp.usage.completion_tokens == 6 * len(gw.fake.reply_ids())
    assert resp.usage.prompt_tokens_details.cached_tokens == 3 * CACHED


def test_completion_batch_streams_every_prompts_choices(gw: Gateway) -> None:
    chunks = list(
        gw.client.completions.create(
            model=MODEL, prompt=["a", "b"], n=2, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == dict.fromkeys(range(4), REPLY)
    assert finishes == {i: ["stop"] for i in range(4)}
    assert len({c.id for c in chunks}) == 1  # one response
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4 * len(
        gw.fake.reply_ids()
    )


def test_a_failing_batch_fails_whole(gw: Gateway) -> None:
    gw.fake.fail = APIError(503, "no live decode worker", "server_error")
    for stream in (False, True):
        body = {"model": MODEL, "prompt": ["a", "b"], "stream": stream}
        assert_error(gw.post("/v1/completions", body), 503)


def test_completion_streaming(gw: Gateway) -> None:
    chunks = list(
        gw.client.completions.create(
            model=MODEL, prompt="Hi", stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        gw.fake.reply_ids()
    )


def test_completion_echo_puts_the_prompt_and_its_logprobs_first(gw: Gateway, tok: Tokenizer):
    """OpenAI's echo (what lm-evaluation-harness scores with: echo, logprobs, max_tokens 1):
    the text is the prompt's then the completion's; with logprobs, the prompt's tokens come
    first (the first with none), from one scoring pass, and the offsets run on."""
    ids = tok.encode("Say hi there")
    resp = gw.client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2)
    [(model, inputs, k)] = gw.fake.scored
    assert (model, inputs, k) == (MODEL, [ids], 2)
    [choice] = resp.choices
    assert choice.text == tok.decode(ids, skip_special_tokens=False) + REPLY
    lp = choice.logprobs
    n = len(ids)
    assert lp.tokens[:n] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[:n] == [None] + [-i / 10 for i in range(1, n)]
    assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[n:] == [-0.25] * len(gw.fake.reply_ids())
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert resp.usage.prompt_tokens == n
    assert resp.usage.completion_tokens == len(gw.fake.reply_ids())
    # Echo without logprobs needs no scoring pass.
    gw.fake.reset()
    resp = gw.client.completions.create(model=MODEL, prompt="Say hi", echo=True)
    assert resp.choices[0].text == "Say hi" + REPLY and resp.choices[0].logprobs is None
    assert gw.fake.scored == []


def test_echo_with_max_tokens_0_answers_the_prompt_alone(gw: Gateway, tok: Tokenizer) -> None:
    texts = ["Say hi", "Bye now"]
    resp = gw.client.completions.create(
        model=MODEL, prompt=texts, echo=True, logprobs=1, max_tokens=0
    )
    assert gw.fake.requests == []  # nothing generated
    [(_, inputs, k)] = gw.fake.scored  # one pass for the batch
    assert inputs == [tok.encode(t) for t in texts] and k == 1
    assert [c.text for c in resp.choices] == texts
    assert all(c.finish_reason == "length" for c in resp.choices)
    for c, ids in zip(resp.choices, inputs, strict=True):
        assert c.logprobs.token_logprobs == [None] + [-i / 10 for i in range(1, len(ids))]
    assert resp.usage.prompt_tokens == sum(map(len, inputs))
    assert resp.usage.completion_tokens == 0


def test_prompt_logprobs_in_vllms_shape(gw: Gateway, tok: Tokenizer) -> None:
    """vLLM's prompt_logprobs: per choice in completions, beside the choices in chat; None
    for the first token, then a dict by token id of the prompt's token (with its rank) and
    the top k."""
    ids = tok.encode("Say hi there")
    r = gw.post("/v1/completions", {"model": MODEL, "prompt": ids, "prompt_logprobs": 2, "n": 2})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        pl = choice["prompt_logprobs"]
        assert len(pl) == len(ids) and pl[0] is None
        for i, place in enumerate(pl[1:], start=1):
            assert list(place)[0] == str(ids[i])
            assert place[str(ids[i])]["logprob"] == pytest.approx(-i / 10)
            assert place[str(ids[i])]["rank"] == i
            assert place["300"]["rank"] == 1 and place["301"]["rank"] == 2
            assert place["301"]["decoded_token"] == tok.decode([301], skip_special_tokens=False)
        assert choice["text"] == REPLY  # no echo
    r = gw.post("/v1/chat/completions", chat_body(prompt_logprobs=0))
    [(_, [chat_ids], k)] = gw.fake.scored[1:]
    body = r.json()
    assert k == 0 and len(body["prompt_logprobs"]) == len(chat_ids)
    assert len(chat_ids) == body["usage"]["prompt_tokens"]
    assert all(len(place) == 1 for place in body["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in body["choices"][0]


def test_streamed_echo_starts_with_the_prompt(gw: Gateway) -> None:
    chunks = list(
        gw.client.completions.create(
            model=MODEL, prompt=["Say hi", "Bye"], echo=True, logprobs=0, stream=True
        )
    )
    texts: dict[int, str] = {}
    offsets: dict[int, list[int]] = {}
    first = {}
    for c in chunks:
        for choice in c.choices:
            first.setdefault(choice.index, choice)
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset)
    assert texts == {0: "Say hi" + REPLY, 1: "Bye" + REPLY}
    assert [first[i].text for i in (0, 1)] == ["Say hi", "Bye"]  # each choice's first chunk
    assert all(f.logprobs.token_logprobs[0] is None for f in first.values())
    assert all(o == sorted(o) and o[0] == 0 for o in offsets.values())


def test_a_failing_scoring_pass_fails_the_request(gw: Gateway) -> None:
    gw.fake.fail = APIError(503, "no live worker to score on", "server_error")
    for body in (
        {"model": MODEL, "prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 0},
        {"model": MODEL, "prompt": "a", "prompt_logprobs": 1},
    ):
        assert_error(gw.post("/v1/completions", body), 503)


def test_a_text_prompt_gets_the_tokenizers_bos_as_in_vllm(tmp_path, smol_dir) -> None:
    """With a tokenizer that adds a BOS (as Llama's do), a completions or embeddings text
    prompt starts with it (vLLM's add_special_tokens, on by default), unless turned off; token
    ids are used as given, and chat does not get a second BOS (the template writes its own)."""
    bos_tok = Tokenizer(make_bos_model_dir(tmp_path / "bos", smol_dir))
    plain = bos_tok.encode("Say hi")
    fake = FakeBackend(bos_tok)
    with serving(create_app(CONFIG, fake, bos_tok)) as port:
        url = f"http://127.0.0.1:{port}"

        def post(path: str, **body) -> httpx.Response:
            r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, headers=AUTH, timeout=10)
            assert r.status_code == 200, r.text
            return r

        post("/v1/completions", prompt="Say hi", max_tokens=2)
        post("/v1/completions", prompt="Say hi", max_tokens=2, add_special_tokens=False)
        post("/v1/completions", prompt=plain, max_tokens=2)
        post("/v1/chat/completions", messages=USER_HI, max_tokens=2)
        post("/v1/embeddings", input="Say hi")
    sent = [list(r.token_ids) for r in fake.requests]
    assert sent[:3] == [[BOS_ID, *plain], plain, plain]
    assert sent[3] == Tokenizer(smol_dir).encode_chat(USER_HI)  # what it is without the BOS
    assert fake.embedded == [(MODEL, [[BOS_ID, *plain]])]


def test_tokenize_gives_the_ids_a_request_runs(gw: Gateway, tok: Tokenizer) -> None:
    """vLLM's /tokenize: a prompt's ids as completions tokenizes it, and chat messages' as
    chat does (compared with what the backend got for the same input), with the context for
    counting against it; /detokenize gives the text back. No backend call."""
    r = gw.post("/tokenize", {"model": MODEL, "prompt": "Say hi", "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = tok.encode_prompt("Say hi")
    assert r.json() == {
        "count": len(ids), "max_model_len": CONFIG.max_model_len, "tokens": ids,
        "token_strs": [tok.decode([t], skip_special_tokens=False) for t in ids],
    }  # fmt: skip
    chat = gw.post("/tokenize", {"prompt": None, "messages": USER_HI}).json()  # model: optional
    assert chat["token_strs"] is None and gw.fake.requests == []
    gw.post("/v1/chat/completions", chat_body(max_tokens=1))
    assert chat["tokens"] == list(gw.fake.requests[0].token_ids)
    bare = gw.post("/tokenize", {"messages": USER_HI, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][: bare["count"]] and bare["count"] < chat["count"]
    back = gw.post("/detokenize", {"model": MODEL, "tokens": chat["tokens"]}).json()
    assert back == {"prompt": tok.decode(chat["tokens"], skip_special_tokens=False)}
    for path, body, status, param in [
        ("/tokenize", {"prompt": "a", "messages": USER_HI}, 400, "prompt"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"messages": USER_HI, "add_special_tokens": True}, 400,
         "add_special_tokens"),
        ("/tokenize", {"messages": USER_HI, "chat_template": "{{ x }}"}, 400, "chat_template"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ]:  # fmt: skip
        assert_error(gw.post(path, body), status, param)


def test_truncate_prompt_tokens_keeps_the_prompts_end(gw: Gateway, tok: Tokenizer) -> None:
    """vLLM's truncate_prompt_tokens: the last k tokens (-1: as many as fit with max_tokens),
    in completions, chat and embeddings; out of range is a 400."""
    ids = list(range(1000, 1600))  # longer than the 512-token context
    r = gw.post("/v1/completions", {"model": MODEL, "prompt": ids, "truncate_prompt_tokens": 7})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 7
    body = {"model": MODEL, "prompt": ids, "truncate_prompt_tokens": -1, "max_tokens": 12}
    assert gw.post("/v1/completions", body).status_code == 200
    gw.post("/v1/chat/completions", chat_body(truncate_prompt_tokens=3))
    sent = [list(r.token_ids) for r in gw.fake.requests]
    assert sent[0] == ids[-7:] and sent[1] == ids[-(CONFIG.max_model_len - 12) :]
    assert sent[2] == tok.encode_chat(USER_HI)[-3:]
    gw.post("/v1/embeddings", {"model": MODEL, "input": [ids[:9]], "truncate_prompt_tokens": 2})
    assert gw.fake.embedded[-1][1] == [ids[7:9]]
    for bad in (0, -2, CONFIG.max_model_len + 1):
        body = {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": bad}
        assert_error(gw.post("/v1/completions", body), 400, "truncate_prompt_tokens")


def test_logprobs_name_tokens_by_id_when_asked(gw: Gateway) -> None:
    """vLLM's return_tokens_as_token_ids: ``token_id:ID`` for every token in logprobs."""
    ids = gw.fake.reply_ids()
    text = gw.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "logprobs": 1,
                                       "return_tokens_as_token_ids": True}).json()  # fmt: skip
    lp = text["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(
        list(top) == [f"token_id:{t}"] for top, t in zip(lp["top_logprobs"], ids, strict=True)
    )
    asked = chat_body(logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    chat = gw.post("/v1/chat/completions", asked).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
    assert text["choices"][0]["text"] == REPLY  # the text itself is unchanged


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(gw: Gateway) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    r = gw.post("/v1/chat/completions", chat_body(stream=True, stream_options=opts))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] for c in chunks)
    assert done == sorted(done) and done[0] == 0 and done[-1] == len(gw.fake.reply_ids())
    assert chunks[-1]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == done[-1]
    body = chat_body(stream=True, stream_options={"continuous_usage_stats": True})
    assert_error(gw.post("/v1/chat/completions", body), 400, "stream_options")


def test_client_request_id_echoed(gw: Gateway) -> None:
    r = gw.post("/v1/chat/completions", chat_body(), headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-42"
    # Inside Tandem the id stays unique even if clients reuse header values.
    assert gw.fake.requests[0].request_id.startswith("chatcmpl-")
    assert r.json()["id"] == gw.fake.requests[0].request_id


def test_chat_template_treats_content_as_data(gw: Gateway, tok: Tokenizer) -> None:
    evil = "{{ 7*7 }} {% for x in range(3) %}loop{% endfor %} {{ raise_exception('x') }}"
    r = gw.post("/v1/chat/completions", chat_body(evil))
    assert r.status_code == 200, r.text
    prompt = tok.decode(gw.fake.requests[0].token_ids, skip_special_tokens=False)
    assert evil in prompt
    assert "49" not in prompt and "looploop" not in prompt


def test_text_parts_and_null_content(gw: Gateway, tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "c"},
    ]
    r = gw.post("/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    prompt = tok.decode(gw.fake.requests[0].token_ids, skip_special_tokens=False)
    assert "user\na\nb<|im_end|>" in prompt and "assistant\n<|im_end|>" in prompt


def test_models_and_health(gw: Gateway) -> None:
    models = gw.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert gw.client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(f"{gw.url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "models": {MODEL: "ready"}}
    assert r.headers["x-request-id"]
    gw.fake.is_healthy = False
    r = httpx.get(f"{gw.url}/health")
    assert r.status_code == 503
    why = "no live decode worker"
    assert r.json() == {"status": "unavailable", "reason": why, "models": {MODEL: why}}
    assert httpx.get(f"{gw.url}/livez").status_code == 200  # alive all the same


# --- Errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"model": "smol", "messages": [', None),  # malformed JSON
        (b"[1, 2]", None),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        (chat_body(max_tokens="5"), "max_tokens"),
        (chat_body(temperature="hot"), "temperature"),
        (chat_body(stream=1), "stream"),
        (chat_body(stop=5), "stop"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages.[0].content"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.[0].role"),
        ({"model": MODEL, "messages": []}, "messages"),
        (chat_body(temperature=-1.0), "temperature"),
        (chat_body(top_p=0), "top_p"),
        (chat_body(max_tokens=0), "max_tokens"),
        (chat_body(top_logprobs=2), "top_logprobs"),
        (chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat_body(stop=["s"] * 17), "stop"),
        (chat_body(stream_options={"include_usage": True}), "stream_options"),
        (chat_body(seed=2**63), "seed"),
        (chat_body(prompt_logprobs=-1), "prompt_logprobs"),
        (chat_body(prompt_logprobs=2, stream=True), "prompt_logprobs"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.[0].content.[0].type",
        ),
    ],
)
def test_bad_chat_request_is_400(gw: Gateway, body, param) -> None:
    err = assert_error(gw.post("/v1/chat/completions", body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert gw.fake.requests == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "prompt": ["a", ""]}, "prompt"),  # a batch with an empty prompt
        ({"model": MODEL, "prompt": [[1], [2, 10**9]]}, "prompt"),
        ({"model": MODEL, "prompt": ["a"] * 65}, "prompt"),  # over MAX_BATCH
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": [1, 10**9]}, "prompt"),
        ({"model": MODEL, "prompt": [1, "a"]}, "prompt"),
        ({"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        (
            {"model": MODEL, "prompt": "x", "echo": True, "max_tokens": 0, "stream": True},
            "max_tokens",
        ),
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": True}, "prompt_logprobs"),
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"model": MODEL, "prompt": "x", "echo": 1}, "echo"),
    ],
)
def test_bad_completion_request_is_400(gw: Gateway, body, param) -> None:
    assert_error(gw.post("/v1/completions", body), 400, param)


def test_n_out_of_range(gw: Gateway) -> None:
    for n in (0, 129):
        err = assert_error(gw.post("/v1/chat/completions", chat_body(n=n)), 400, "n")
        assert "n must be in [1, 128]" in err["message"]


def test_unknown_model_is_404(gw: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        gw.client.chat.completions.create(model="gpt-9", messages=USER_HI)
    assert e.value.code == "model_not_found"
    err = assert_error(gw.post("/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"


def test_prompt_too_long(gw: Gateway) -> None:
    err = assert_error(gw.post("/v1/completions", {"model": MODEL, "prompt": "hi " * 600}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in err["message"]
    # Short prompt, but prompt + max_tokens does not fit.
    err = assert_error(gw.post("/v1/chat/completions", chat_body(max_tokens=500)), 400, "messages")
    assert "512" in err["message"] and "500 in the completion" in err["message"]


def test_stop_token_ids_reach_the_sampling_params(gw: Gateway, tok: Tokenizer) -> None:
    """vLLM's ``stop_token_ids`` extension: it was silently ignored (a field no OpenAI API
    defines); now it reaches the workers, and a bad id is a 400 naming it."""
    body = ChatCompletionRequest.model_validate(chat_body(stop_token_ids=[5, 7]))
    p = prepare_chat(CONFIG, tok, body, "chatcmpl-1", "t")
    assert p.backend_request.sampling.stop_token_ids == (5, 7)
    assert_error(gw.post("/v1/chat/completions", chat_body(stop_token_ids=[-1])), 400,
                 "stop_token_ids")  # fmt: skip
    assert_error(gw.post("/v1/chat/completions", chat_body(stop_token_ids=["a"])), 400)


def test_min_tokens_stop_text_and_special_tokens_reach_the_sampling_params(
    gw: Gateway, tok: Tokenizer
) -> None:
    """vLLM's min_tokens, include_stop_str_in_output and skip_special_tokens were refused as not
    implemented; now they reach the workers (through the router's codec as well)."""
    from services.common.codec import sampling_from_pb, sampling_to_pb

    asked = dict(min_tokens=3, max_tokens=9, include_stop_str_in_output=True,
                 skip_special_tokens=False)  # fmt: skip
    p = prepare_chat(
        CONFIG, tok, ChatCompletionRequest.model_validate(chat_body(**asked)), "c", "t"
    )
    sp = p.backend_request.sampling
    assert (sp.min_tokens, sp.include_stop_str_in_output, sp.skip_special_tokens) == (
        3,
        True,
        False,
    )
    assert sampling_from_pb(sampling_to_pb(sp)) == sp
    plain = prepare_chat(CONFIG, tok, ChatCompletionRequest.model_validate(chat_body()), "c", "t")
    assert sampling_from_pb(sampling_to_pb(plain.backend_request.sampling)).skip_special_tokens
    body = chat_body(min_tokens=10, max_tokens=9)
    assert_error(gw.post("/v1/chat/completions", body), 400, "min_tokens")
    body = chat_body(min_tokens=2, response_format={"type": "json_object"})
    assert_error(gw.post("/v1/chat/completions", body), 400, "min_tokens")


def test_default_max_tokens_fills_the_rest_of_the_context(tok: Tokenizer) -> None:
    ids = list(range(20, 20 + 450))
    body = CompletionRequest(model=MODEL, prompt=ids)
    p = prepare_completion(CONFIG, tok, body, "cmpl-1", "t")
    assert p.backend_request.sampling.max_tokens == CONFIG.max_model_len - 450
    chat = ChatCompletionRequest.model_validate(chat_body())
    p = prepare_chat(CONFIG, tok, chat, "chatcmpl-1", "t")
    assert p.backend_request.sampling.max_tokens == CONFIG.default_max_tokens
    assert p.top_logprobs is None and not p.stream


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_auth(gw: Gateway, key) -> None:
    err = assert_error(gw.post("/v1/chat/completions", chat_body(), key=key), 401)
    assert err["code"] == "invalid_api_key"
    assert gw.fake.requests == []
    with openai_client(gw.url, "nope") as client, pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_backend_unavailable_is_503(gw: Gateway) -> None:
    gw.fake.fail = APIError(503, "no decode workers", "server_error", code="service_unavailable")
    err = assert_error(gw.post("/v1/chat/completions", chat_body()), 503)
    assert err["message"] == "no decode workers"
    # Streaming too: the failure comes before the first event, so the status is real.
    assert_error(gw.post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}), 503)
    with pytest.raises(openai.InternalServerError):
        gw.client.chat.completions.create(model=MODEL, messages=USER_HI)


def test_backend_bug_is_500_without_details(gw: Gateway) -> None:
    gw.fake.fail = RuntimeError("secret internal state")  # type: ignore[assignment]
    err = assert_error(gw.post("/v1/chat/completions", chat_body()), 500)
    assert "secret" not in err["message"]


def test_body_too_large_is_413(gw: Gateway) -> None:
    big = json.dumps(chat_body("x" * (CONFIG.max_body_bytes + 10)))
    err = assert_error(gw.post("/v1/chat/completions", big), 413)
    assert str(CONFIG.max_body_bytes) in err["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while read
        data = big.encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    assert_error(gw.post("/v1/chat/completions", None, content=chunked()), 413)


def test_unknown_route_is_openai_json(gw: Gateway) -> None:
    assert_error(gw.post("/v1/nothing", {}), 404)


# --- Disconnects --------------------------------------------------------------------------------


@pytest.mark.parametrize("hang_after", [0, 2])
def test_stream_disconnect_aborts_within_1s(gw: Gateway, hang_after: int) -> None:
    gw.fake.hang_after = hang_after
    with httpx.Client(timeout=10) as client:
        if hang_after:
            body = {"model": MODEL, "prompt": "x", "stream": True}
            with client.stream("POST", f"{gw.url}/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
        else:  # hangs before the first token: the client gives up waiting for headers
            with pytest.raises(httpx.ReadTimeout):
                url = f"{gw.url}/v1/chat/completions"
                client.post(url, json=chat_body(stream=True), headers=AUTH, timeout=0.3)
    # The connection is closed by now.
    assert gw.fake.abort_called.wait(1.0), "abort not called within 1 s of the disconnect"
    assert gw.fake.aborted == [gw.fake.requests[0].request_id]


def test_non_streaming_disconnect_aborts_within_1s(gw: Gateway) -> None:
    gw.fake.hang_after = 1
    with pytest.raises(httpx.ReadTimeout):
        gw.post("/v1/chat/completions", chat_body(), timeout=0.3)
    assert gw.fake.abort_called.wait(1.0)
    assert gw.fake.aborted == [gw.fake.requests[0].request_id]


@pytest.mark.parametrize("stream", [True, False])
def test_a_batchs_disconnect_aborts_every_prompt(gw: Gateway, stream: bool) -> None:
    gw.fake.hang_after = 2
    body = {"model": MODEL, "prompt": ["x", "y", "z"], "stream": stream}
    with httpx.Client(timeout=10) as client:
        if stream:
            with client.stream("POST", f"{gw.url}/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200
                assert next(r.iter_lines()).startswith("data: {")
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(f"{gw.url}/v1/completions", json=body, headers=AUTH, timeout=0.3)
    deadline = time.monotonic() + 2
    while len(gw.fake.aborted) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(gw.fake.aborted) == sorted(r.request_id for r in gw.fake.requests)
    assert len(gw.fake.aborted) == 3


# --- Config -------------------------------------------------------------------------------------


def test_parse_config_flags() -> None:
    from services.gateway.__main__ import parse_config

    cfg = parse_config(
        [
            "--model-dir",
            str(DEFAULT_DIR),
            "--router",
            "a:1",
            "--router",
            "b:2",
            "--port",
            "9000",
            "--api-key",
            "k1",
            "--api-key",
            "k2:team",
            "--max-body-bytes",
            "1000",
        ],
        env={"TANDEM_ROUTER": "ignored:1", "TANDEM_API_KEY": "ignored"},
    )
    assert cfg.routers == ("a:1", "b:2") and cfg.port == 9000 and cfg.host == "127.0.0.1"
    assert cfg.api_keys == (
        ApiKey(hash_key("k1"), tenant_of_hash(hash_key("k1"))),
        ApiKey(hash_key("k2"), "team"),
    )
    assert "k1" not in repr(cfg)  # only hashes are kept
    assert cfg.served_model_name == DEFAULT_DIR.name
    assert cfg.max_model_len == 8192  # SmolLM2's max_position_embeddings
    assert cfg.max_body_bytes == 1000
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]


def test_parse_config_env_fallbacks() -> None:
    from services.gateway.__main__ import parse_config

    env = {"TANDEM_ROUTER": "x:1, y:2", "TANDEM_API_KEY": "a:t1,b:t2"}
    cfg = parse_config(["--model-dir", str(DEFAULT_DIR), "--served-model-name", "m"], env=env)
    assert cfg.routers == ("x:1", "y:2")
    assert [(k.sha256, k.tenant) for k in cfg.api_keys] == [
        (hash_key("a"), "t1"),
        (hash_key("b"), "t2"),
    ]
    assert cfg.served_model_name == "m"
    with pytest.raises(SystemExit):  # no router at all
        parse_config(["--model-dir", str(DEFAULT_DIR)], env={})
    with pytest.raises(SystemExit):  # longer than the model's context
        parse_config(["--model-dir", str(DEFAULT_DIR), "--max-model-len", "9000"], env=env)


def test_session_key_from_user_field_or_header(gw: Gateway) -> None:
    """The sticky-routing key: the OpenAI ``user`` field, else the X-Session-Id header."""
    assert gw.post("/v1/chat/completions", chat_body(user="u1")).status_code == 200
    r = gw.post("/v1/chat/completions", chat_body(), headers={"X-Session-Id": "s-9"})
    assert r.status_code == 200
    both = chat_body(user="u2")
    assert gw.post("/v1/chat/completions", both, headers={"X-Session-Id": "s-9"}).status_code == 200
    assert gw.post("/v1/chat/completions", chat_body()).status_code == 200
    assert [req.session for req in gw.fake.requests] == ["u1", "s-9", "u2", ""]


def test_max_model_len_caps_every_model(tmp_path) -> None:
    """--max-model-len caps each base model at its own context, as its workers do; one above
    every model's context is refused."""
    from services.gateway.__main__ import parse_config
    from services.gateway.config import model_configs

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    cfg = json.loads((DEFAULT_DIR / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 1024}))
    base = ["--model-dir", str(DEFAULT_DIR), "--router", "a:1", f"--extra-model=tiny={tiny}"]
    lens = [c.max_model_len for c in model_configs(parse_config(base, env={}))]
    assert lens == [8192, 1024]  # each its own context
    lens = [c.max_model_len for c in model_configs(parse_config([*base, "--max-model-len=2048"]))]
    assert lens == [2048, 1024]
    lens = [c.max_model_len for c in model_configs(parse_config([*base, "--max-model-len=512"]))]
    assert lens == [512, 512]
    with pytest.raises(SystemExit):
        parse_config([*base, "--max-model-len=9000"])
