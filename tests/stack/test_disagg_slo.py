"""Per-request SLOs and the router's disagg choice end to end: real etcd, gateway, router, one
prefill and one decode worker as processes on loopback. Workers report their measured pace in
their member records; a request's SLO (body field or header) reaches the router through the
gateway and decides there (here: shed at once when no worker can come near its TTFT objective,
served when it can), and every decision is counted by choice and reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from libkv.cluster.registry import Member, MemberWatcher
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig

pytestmark = pytest.mark.timeout(300)

LONG = " ".join(
    f"Entry {i}: crate {i * 7} left dock {i % 5} on time." for i in range(30)
)  # ~450 tokens


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory) -> Iterator[Stack]:
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path_factory.mktemp("disagg_slo")),
        port=free_port(),
        num_prefill=1,
        num_decode=1,
        member_ttl=3,
        member_refresh=0.5,
        router_args=("--slo-shed-factor", "2"),
    )
    with Stack(config) as s:
        yield s


def members(stack: Stack) -> dict[str, Member]:
    async def read() -> dict[str, Member]:
        watcher = await MemberWatcher.start([stack.etcd.endpoint])
        try:
            return {m.role: m for m in watcher.members.values()}
        finally:
            await watcher.stop()

    return asyncio.run(read())


def router_counts(stack: Stack) -> dict[tuple[str, str], float]:
    """(choice, reason) -> decisions, and ("shed", "") -> requests shed, from the router."""
    from prometheus_client.parser import text_string_to_metric_families

    address = stack.scrape_targets()["router"]
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tandem_router_disagg_decisions_total":
                out[(s.labels["choice"], s.labels["reason"])] = s.value
            elif s.name == "tandem_router_slo_shed_total":
                out[("shed", "")] = s.value
    return out


def chat(stack: Stack, slo: dict | None = None, headers: dict | None = None) -> httpx.Response:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": 4,
        "temperature": 0,
        **(slo or {}),
    }
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers or {},
                      timeout=120)  # fmt: skip


def test_pace_reports_slo_propagation_and_decisions(stack: Stack) -> None:
    # Cold start: no measured rate yet, the length rule sends these long prompts to the
    # prefill worker, which measures its rate; the decode worker measures its steps. (Loose
    # objectives: a shared CPU computes a few hundred prompt tokens a second at best.)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)
    for _ in range(2):
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": LONG}],
            max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "slo_ttft_ms": 600_000, "slo_tpot_ms": 60_000},
        )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        view = members(stack)
        prefill, decode = view["prefill"].load, view["decode"].load
        if prefill.prefill_tokens_per_s > 0 and decode.decode_step_ms > 0:
            break
        assert time.monotonic() < deadline, f"no pace in the member records: {view}"
        time.sleep(0.3)
    assert prefill.max_batched_tokens > 0 and prefill.prefill_backlog == 0
    assert router_counts(stack).get(("disagg", "cold-start"), 0) >= 1

    # A TTFT objective of 1 ms, from the body (extra_body) or a header: no worker computes
    # this prompt within 2x that, so the router sheds it at once: 429 with a Retry-After.
    for r in (chat(stack, {"slo_ttft_ms": 1}), chat(stack, headers={"x-tandem-slo-ttft-ms": "1"})):
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
    counts = router_counts(stack)
    assert counts[("shed", "")] == 2
    # An objective it can meet: served, and decided by the prediction (no longer cold-start).
    before = counts
    r = chat(stack, {"slo_ttft_ms": 120_000, "slo_tpot_ms": 60_000})
    assert r.status_code == 200, r.text
    after = router_counts(stack)
    grown = {k for k in after if k[0] != "shed" and after[k] > before.get(k, 0)}
    assert len(grown) == 1 and next(iter(grown))[1] in ("headroom", "saturated", "both-miss")
    # The router's log names the decision of each request it routed.
    log = stack.children["router"].log_path.read_text()
    assert "Decision(choice=" in log
    # An invalid objective never reaches the router.
    bad = chat(stack, headers={"x-tandem-slo-tpot-ms": "-3"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-tandem-slo-tpot-ms"
