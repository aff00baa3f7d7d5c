"""End to end: real etcd and the four services as processes on loopback, driven through the
gateway with the official ``openai`` client. The disaggregated path (prefill -> KV blocks over
NIXL, and again over the gRPC stream -> decode) and the decode-only path must match the offline
engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from libkv.transfer.nixl_agent import nixl_available
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack_probe import worker_stats

MODEL = "SmolLM2-135M-Instruct"
LONG = " ".join(
    f"Line {i}: the warehouse shipped {i * 7} crates to dock {i % 5}." for i in range(40)
)
# For tests that count tokens: greedy and past EOS, so the count never depends on the sample.
EXACT = {"temperature": 0, "extra_body": {"ignore_eos": True}}


# The whole suite runs once per KV transport: NIXL (where importable) and the gRPC stream.
TRANSPORTS = ["nixl", "grpc"] if nixl_available() else ["grpc"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def stack(smol_dir, tmp_path_factory, request):
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path_factory.mktemp("stack")),
        port=free_port(),
        num_prefill=1,
        num_decode=2,
        member_ttl=3,
        member_refresh=1.0,
        kv_transport=request.param,
        disagg_mode="length",  # placement by length alone, whatever the load
    )
    workers = ("prefill-0", "decode-0", "decode-1")
    with Stack(config) as s:
        if request.param == "nixl":  # really NIXL, not a silent fallback to the gRPC stream
            for name in workers:
                assert "KV transport: NIXL" in s.children[name].log_path.read_text()
        yield s
        # Decode recomputes a prompt whose KV did not arrive, which would hide a broken
        # transport behind correct output: no transfer may have failed.
        for name in workers:
            assert "did not arrive" not in s.children[name].log_path.read_text(), name


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(smol_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=64 * 1024**2))


def offline_greedy(engine: LLMEngine, prompt: list[int], max_tokens: int):
    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def assert_all_free(stack: Stack, within: float = 1.0) -> None:
    deadline = time.monotonic() + within
    while True:
        stats = worker_stats(stack)
        busy = {
            n: (s.kv_blocks_used, s.held_requests)
            for n, s in stats.items()
            if s.kv_blocks_used or s.held_requests
        }
        if not busy:
            assert all(s.integrity_ok for s in stats.values())
            return
        assert time.monotonic() < deadline, f"blocks still in use: {busy}"
        time.sleep(0.05)


def test_disaggregated_and_decode_only_match_offline(stack, client, offline):
    tok = offline.tokenizer
    long_ids = tok.encode(LONG)
    assert len(long_ids) >= 256  # over the decode-only threshold: prefill + transfer + decode
    before = worker_stats(stack)["prefill-0"].prompt_tokens
    for prompt in (LONG, "The capital of France is"):
        ref = offline_greedy(offline, tok.encode(prompt), 24)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.usage.prompt_tokens == len(tok.encode(prompt))
    assert worker_stats(stack)["prefill-0"].prompt_tokens - before == len(long_ids)
    assert_all_free(stack)


def test_chat_streaming_usage_and_options(stack, client, offline):
    tok = offline.tokenizer
    messages = [{"role": "user", "content": "List three fruits."}]
    prompt_len = len(tok.encode_chat(messages))
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0
    )
    text = full.choices[0].message.content
    assert full.usage.prompt_tokens == prompt_len
    ref = offline_greedy(offline, tok.encode_chat(messages), 30)
    assert text == ref.text and full.usage.completion_tokens == len(ref.token_ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, **EXACT)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"

    stop_at = text.split()[1]
    stopped = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0, stop=[stop_at]
    )
    assert stopped.choices[0].message.content == text[: text.index(stop_at)]
    assert stopped.choices[0].finish_reason == "stop"

    seeded = [
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, temperature=1.0, seed=42
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]

    lp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob - 1e-4 for c in content)
    assert_all_free(stack)


def test_disconnect_frees_blocks_on_both_workers(stack):
    body = {
        "model": MODEL,
        "prompt": LONG,
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", stack.url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen == 5:  # still streaming: the decode worker holds the request's blocks
                stats = worker_stats(stack)
                assert sum(s.kv_blocks_used for s in stats.values()) > 0
                break  # leaving iter_lines closes the connection: a client disconnect
    assert_all_free(stack, within=1.0)


def test_bad_inputs_get_clear_errors_while_good_request_completes(stack):
    good_body = {"model": MODEL, "prompt": LONG, "max_tokens": 30, "temperature": 0}
    url = stack.url + "/v1/completions"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(httpx.post, url, json=good_body, timeout=120)
        cases = [
            (b"{not json", 400),
            (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "many"}).encode(), 400),
            (json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404),
            (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 10**6}).encode(), 400),
            (json.dumps({"model": MODEL, "prompt": "hi", "n": 0}).encode(), 400),
        ]
        for body, status in cases:
            r = httpx.post(url, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["message"] and {"type", "param", "code"} <= set(err)
        too_long = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 10**6})
        assert "8192" in too_long.json()["error"]["message"]
        assert good.result().status_code == 200
        assert good.result().json()["usage"]["completion_tokens"] == 30
    assert_all_free(stack)


def test_a_request_without_max_tokens_is_served(stack, client):
    """OpenAI's clients often leave out max_tokens: the gateway's default (up to 4,096 tokens)
    must fit a worker's pool. On the CPU stack it did not (128 MiB held 2,912 tokens: a 400
    about KV blocks); the stack's pools now hold the context it advertises
    (`services.launcher.kv_budget`)."""
    (model,) = [m for m in client.models.list().data if m.id == MODEL]
    assert model.model_extra["max_model_len"] == 8192
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        temperature=0,
        stop=[" ", "."],  # a word: the default max_tokens is admitted, not used up
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    assert_all_free(stack)


def test_a_batch_of_prompts_answers_each_as_alone(stack, client, offline):
    """A completions batch (a list of prompts) runs one request per prompt through the real
    stack; each prompt's greedy text is what it gets alone, in the order given."""
    prompts = ["The capital of France is", "1, 2, 3, 4,", LONG]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    refs = [offline_greedy(offline, offline.tokenizer.encode(p), 8) for p in prompts]
    assert [c.text for c in batch.choices] == [r.text for r in refs]
    sizes = [len(offline.tokenizer.encode(p)) for p in prompts]
    assert batch.usage.prompt_tokens == sum(sizes)
    assert batch.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    assert_all_free(stack)


def test_echo_with_logprobs_scores_prompts_as_lm_eval_asks(stack, client, offline):
    """lm-evaluation-harness's loglikelihood request (a batch of token-id prompts, echo,
    logprobs 1, max_tokens 1, greedy): each prompt's tokens' logprobs come from a worker's
    scoring pass and match the offline engine's; the generated token's, from the decode
    worker's sampler, matches the scoring pass of the prompt with it appended."""
    tok = offline.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode(LONG)[:300]]
    out = client.completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    for choice, ids in zip(out.choices, prompts, strict=True):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = offline.prompt_logprobs(ids, 1)
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx([e.logprob for e in ref], abs=1e-4)
        # The greedy token is the top-1 alternative, so lm-eval's "is greedy" test holds.
        assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))
        greedy = offline_greedy(offline, ids, 1).token_ids
        assert choice.text == tok.decode(ids, skip_special_tokens=False) + tok.decode(greedy)
        again = offline.prompt_logprobs(ids + greedy, 0)[-1]
        assert lp.token_logprobs[-1] == pytest.approx(again.logprob, abs=1e-3)
    # The prompt alone (max_tokens 0), and vLLM's prompt_logprobs in chat.
    alone = client.completions.create(
        model=MODEL, prompt=prompts[0], echo=True, logprobs=0, max_tokens=0
    )
    assert alone.choices[0].text == "The capital of France is"
    assert alone.usage.completion_tokens == 0
    chat = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 2, "prompt_logprobs": 2},
        timeout=60,
    )  # fmt: skip
    body = chat.json()
    assert chat.status_code == 200, body
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(1 <= len(place) <= 3 for place in body["prompt_logprobs"][1:])
    assert_all_free(stack)


def test_min_tokens_holds_the_stop_token_back_on_the_prefill_worker(stack, client, offline):
    """vLLM's min_tokens through the disaggregated path: the prefill worker samples the first
    token, so it must mask the stop token there (the answer equals the offline engine's); the
    stop token's text is left out, as vLLM does, unless include_stop_str_in_output."""
    ids = offline.tokenizer.encode(LONG)  # over the decode-only threshold: prefilled first
    first = offline_greedy(offline, ids, 1).token_ids[0]
    greedy = {"model": MODEL, "prompt": LONG, "max_tokens": 8, "temperature": 0}
    stopped = client.completions.create(**greedy, extra_body={"stop_token_ids": [first]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].text == ""
    asked = {"stop_token_ids": [first], "min_tokens": 2, "include_stop_str_in_output": True}
    held = client.completions.create(**greedy, extra_body=asked)
    rid = f"ref-{time.monotonic_ns()}"
    offline.add_request(
        rid,
        ids,
        SamplingParams(max_tokens=8, temperature=0, **asked),  # type: ignore[arg-type]
    )
    ref = None
    while offline.has_unfinished():
        ref = next((o for o in offline.step() if o.finished), ref)
    assert ref is not None and held.choices[0].text == ref.text
    assert held.usage.completion_tokens == len(ref.token_ids) >= 2
    assert first not in ref.token_ids[:2]
    assert_all_free(stack)


def test_stop_reason_is_null_at_eos_and_the_id_of_a_stop_token(client, offline):
    """vLLM's stop_reason: null when the model ends (EOS), the id (a JSON number) when a token
    of stop_token_ids does, the string when a stop string does. It was the string "2" for
    SmolLM2's EOS."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    eos = client.chat.completions.create(**chat, max_tokens=40).choices[0]
    assert eos.finish_reason == "stop" and eos.model_extra["stop_reason"] is None
    end = offline.tokenizer.eos_token_id  # <|im_end|>, SmolLM2-Instruct's EOS
    assert isinstance(end, int)
    by_id = client.chat.completions.create(
        **chat, max_tokens=40, extra_body={"stop_token_ids": [end]}
    ).choices[0]
    assert by_id.message.content == eos.message.content
    assert by_id.finish_reason == "stop" and by_id.model_extra["stop_reason"] == end
    assert type(by_id.model_extra["stop_reason"]) is int


def test_internal_grpc_client(stack, client, offline):
    from services.client import TandemClient, TandemClientError

    router = stack.children["router"].address
    ids = offline.tokenizer.encode(LONG)
    ref = offline_greedy(offline, ids, 12)

    async def go():
        async with TandemClient(router) as c:
            by_ids = await c.complete(ids, max_tokens=12, temperature=0)
            by_text = await c.complete(LONG, max_tokens=12, temperature=0)
            with pytest.raises(TandemClientError) as err:
                await c.complete([10**6], max_tokens=4)
            # Abort by id from another task while the request streams.
            events = []

            async def consume():
                async for ev in c.generate(
                    "Count:", request_id="to-abort", max_tokens=300, ignore_eos=True
                ):
                    events.append(ev)

            task = asyncio.ensure_future(consume())
            for _ in range(600):
                if len(events) >= 3 or task.done():
                    break
                await asyncio.sleep(0.05)
            assert len(events) >= 3
            assert await c.abort("to-abort")
            await asyncio.wait_for(task, 10)  # the stream ends with an abort event
            assert events[-1].finish_reason == "abort" and len(events) < 300
            return by_ids, by_text, err.value

    by_ids, by_text, err = asyncio.run(go())
    assert by_ids.token_ids == ref.token_ids and by_ids.text == ref.text
    assert by_text.token_ids == ref.token_ids
    assert by_ids.usage.prompt_tokens == len(ids) and by_ids.usage.completion_tokens == 12
    assert err.code == "INVALID_ARGUMENT" and "token ids" in err.message
    assert_all_free(stack)


@pytest.mark.stack  # the faults: `make test-stack`
def test_killing_a_decode_worker_moves_traffic(stack, client):
    stack.kill("decode-1")
    # Until the lease lapses the router may still pick decode-1; it fails before the first
    # token, so the router retries on decode-0 and every request succeeds.
    deadline = time.monotonic() + stack.config.member_ttl + 2
    done = 0
    while time.monotonic() < deadline or done < 4:
        out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, **EXACT)
        assert out.usage.completion_tokens == 4
        done += 1
    stack.restart("decode-1")


@pytest.mark.stack
def test_serving_survives_an_etcd_restart(stack, client):
    stack.etcd.kill()
    # Routers keep their last view and workers keep running while etcd is down.
    out = client.completions.create(model=MODEL, prompt=LONG, max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    stack.etcd.restart()
    time.sleep(stack.config.member_ttl + 1)  # leases of the old etcd term have lapsed by now
    for prompt in ("Hello there", LONG):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **EXACT)
        assert out.usage.completion_tokens == 4
    assert_all_free(stack)
