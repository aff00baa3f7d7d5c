"""Requests that leave ``max_tokens`` out, end to end (etcd, router, a prefill and a decode worker,
the gateway; the bundled model): admission books ``--default-booked-tokens`` for them, not their
cap, so a decode worker whose bound holds one such request booked whole takes several at once;
and they run past their booking, with the KV pool too small for all of them, never refused or
cut: each gets every token to its cap (the engine preempts and recomputes instead)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack.test_e2e_stack import MODEL, assert_all_free
from tests.stack_probe import metrics_of

N = 4  # concurrent requests
# Token ids (exact lengths): 8 tokens go prefill -> Decode.Reserve -> hand-off -> decode; 7 go
# decode-only (booked by the decode worker's own ledger), as short chats do on `tandem serve`.
PROMPTS = {"prefilled": list(range(1000, 1008)), "decode-only": list(range(2000, 2007))}
THRESHOLD = 8  # --decode-only-threshold
CAP = 16  # --default-max-tokens
BOOKED = 2  # --default-booked-tokens
# The decode worker's bound: N requests booked as BOOKED fit, two booked whole (the cap) do not.
PENDING = 44  # (the prefill worker's too: it books the prompts alone)
KV_BLOCKS = 4  # of 16 tokens: a 48-token context; N requests run to their cap need 8 blocks


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory):
    config = StackConfig(
        model_dir=str(smol_dir), run_dir=str(tmp_path_factory.mktemp("booking")),
        port=free_port(), num_prefill=1, num_decode=1, kv_transport="grpc",
        decode_only_threshold=THRESHOLD,
        disagg_mode="length",  # placement by length alone, whatever the load
        num_kv_blocks=KV_BLOCKS,
        worker_args=("--max-pending-tokens", str(PENDING)),
        gateway_args=("--default-max-tokens", str(CAP), "--default-booked-tokens", str(BOOKED)),
    )  # fmt: skip
    with Stack(config) as s:
        yield s


def test_the_numbers_make_the_old_booking_refuse() -> None:
    """What the stack's numbers are chosen for (so the tests below can fail): N requests fit
    the bound as booked, two booked whole (the cap, as before) do not, and the KV pool cannot
    hold N run to their cap."""
    assert len(PROMPTS["decode-only"]) < THRESHOLD <= len(PROMPTS["prefilled"])
    for prompt in PROMPTS.values():
        assert N * (len(prompt) + BOOKED) <= PENDING < 2 * (len(prompt) + CAP)
        assert N * -(-(len(prompt) + CAP) // 16) > KV_BLOCKS


def decisions(stack: Stack, reason: str) -> float:
    """The router's routing decisions for ``reason`` so far."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{stack.scrape_targets()['router']}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "tandem_router_decisions"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("reason") == reason
    )


async def burst(url: str, prompt: list[int], **body) -> list[httpx.Response]:
    """N concurrent completions of ``prompt``, greedy and past EOS, with no max_tokens (as most
    OpenAI clients send them) unless ``body`` gives one."""
    req = {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True, **body}
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(
            *(client.post(f"{url}/v1/completions", json=req) for _ in range(N))
        )


@pytest.mark.parametrize("route", list(PROMPTS))
def test_requests_without_max_tokens_are_all_admitted_and_run_past_their_booking(
    stack, route: str
) -> None:
    """All N are admitted, and each runs to its cap, 8 times its booking: together they hold
    more than the bound and twice the KV pool, and none is refused or cut once started."""
    prompt = PROMPTS[route]
    decode = stack.scrape_targets()["decode-0"]
    before = metrics_of(decode).get("tandem_engine_preemptions_total", 0.0)
    routed = decisions(stack, "decode-only")
    answers = asyncio.run(burst(stack.url, prompt))
    assert [r.status_code for r in answers] == [200] * N, [r.text for r in answers]
    for r in answers:
        body = r.json()
        usage = body["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), CAP)
        assert body["choices"][0]["finish_reason"] == "length"
    # The pool cannot hold them all: the engine preempted and recomputed rather than fail one.
    assert metrics_of(decode)["tandem_engine_preemptions_total"] > before
    assert decisions(stack, "decode-only") - routed == (N if route == "decode-only" else 0)
    assert_all_free(stack, within=10)


def test_the_same_requests_with_max_tokens_given_are_booked_whole(stack) -> None:
    """With max_tokens at the cap (booked whole, as before), one fits the bound at a time: the
    others get 429 while it runs, and every 200 is a whole answer. Last: its refusals are
    remembered for a second."""
    answers = asyncio.run(burst(stack.url, PROMPTS["prefilled"], max_tokens=CAP))
    codes = sorted(r.status_code for r in answers)
    assert set(codes) == {200, 429} and codes.count(200) < N, codes
    for r in answers:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == CAP
        else:
            assert r.json()["error"]["code"] == "server_overloaded"
    assert_all_free(stack, within=10)
