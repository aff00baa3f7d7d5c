"""Stacks whose prefill and decode pools run at different tensor-parallel sizes (CPU, gloo, the
bundled SmolLM2): P tp=2 -> D tp=1 and P tp=1 -> D tp=2 hand KV off and answer token for token
as the colocated engine does, over NIXL (each decode rank READs its heads from the prefill ranks
that hold them, `libkv.transfer.sharded`) and over the gRPC block stream (canonical blocks that
rank 0 gathers or scatters); the member records carry the TP size, the KV layout and every
rank's NIXL agent; a rank killed with -9 takes its worker down and its member key lapses.

SmolLM2 has 3 KV heads: at TP=2 one rank holds 1 of them, the other 2 (``engine.parallel.shard``),
so the hand-off re-slices heads unevenly in both directions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.parallel.ranks import RANK_DIED
from libkv.cluster.registry import Member, MemberWatcher
from libkv.kv_layout import KVLayout
from libkv.transfer.nixl_agent import nixl_available
from libkv.transfer.sharded import rank_agent_name, rank_agents
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack_probe import members, worker_stats

pytestmark = pytest.mark.stack  # two stacks of TP=2 workers and a killed rank: `make test-stack`

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    " ".join(f"Line {i}: the warehouse shipped {i * 7} crates to dock {i % 5}." for i in range(30)),
    " ".join(f"Step {i}: add {i} grams of flour and stir for {i + 2} minutes." for i in range(30)),
]


# Over NIXL where it is importable (the gRPC stream, the fallback, then only in the slow run).
PAIRS = [pytest.param((2, 1, "grpc"), id="p2-d1-grpc")]
if nixl_available():
    PAIRS = [
        pytest.param((2, 1, "nixl"), id="p2-d1-nixl"),
        pytest.param((1, 2, "nixl"), id="p1-d2-nixl"),
        pytest.param((2, 1, "grpc"), id="p2-d1-grpc", marks=pytest.mark.slow),
    ]


@pytest.fixture(scope="module", params=PAIRS)
def stack(smol_dir, tmp_path_factory, request):
    prefill_tp, decode_tp, transport = request.param
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path_factory.mktemp("tp-stack")),
        port=free_port(),
        num_prefill=1,
        num_decode=1,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        member_ttl=3,
        member_refresh=1.0,
        start_timeout=300.0,
        kv_transport=transport,
        # Every long prompt to the prefill worker: these tests are about its hand-off.
        disagg_mode="length",
    )
    with Stack(config) as s:
        yield s


@pytest.fixture(scope="module")
def offline(smol_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=64 * 1024**2))


def greedy(engine: LLMEngine, prompt: list[int], max_tokens: int) -> str:
    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                text = out.text
    return text


def member_records(stack: Stack) -> dict[str, Member]:
    async def read() -> dict[str, Member]:
        watcher = await MemberWatcher.start([stack.etcd.endpoint])
        try:
            return {m.worker_id: m for m in watcher.members.values()}
        finally:
            await watcher.stop()

    return asyncio.run(read())


def test_handoff_between_tp_sizes_matches_colocated(stack, offline):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=300)
    tok = offline.tokenizer
    before = worker_stats(stack)["prefill-0"].prompt_tokens
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert len(ids) >= 256  # over the decode-only threshold: prefill, hand-off, decode
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text == greedy(offline, ids, 8)
    # The prompts were prefilled by the prefill worker and their KV arrived (a failed transfer
    # would be recomputed by the decode worker, hiding a broken hand-off behind right output).
    assert worker_stats(stack)["prefill-0"].prompt_tokens - before == sum(
        len(tok.encode(p)) for p in PROMPTS
    )
    decode_log = stack.children["decode-0"].log_path.read_text()
    assert "did not arrive" not in decode_log
    # Checked at both TP sizes: the sums of the prefill ranks match the decode ranks'.
    assert "arrived corrupt" not in decode_log
    stats = worker_stats(stack)
    assert all(s.integrity_ok for s in stats.values())
    moved = transfers(stack, "decode-0")
    assert moved == {stack.config.kv_transport: len(PROMPTS)}, moved


def transfers(stack: Stack, name: str) -> dict[str, int]:
    """Hand-offs the decode worker counted, by path (only paths that moved something)."""
    port = stack.children[name].metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tandem_kv_transfers_total{") and float(line.split()[-1]) > 0:
            path = line.split('transport="')[1].split('"')[0]
            out[path.removesuffix("-read")] = int(float(line.split()[-1]))
    return out


def test_member_records_carry_tp_size_and_layout(stack):
    records = member_records(stack)
    c = stack.config
    for worker_id, tp in (("prefill-0", c.prefill_tp), ("decode-0", c.decode_tp)):
        m = records[worker_id]
        assert m.tensor_parallel_size == tp
        layout = KVLayout.from_extra(m.extra)
        assert layout is not None and layout.tp == tp and layout.num_kv_heads == 3
        agents = rank_agents(m.extra)
        if c.kv_transport == "nixl":  # every rank's agent, named after the incarnation
            assert [a.name for a in agents] == [
                rank_agent_name(worker_id, m.incarnation, r) for r in range(tp)
            ]
            assert [a.region.block_bytes for a in agents] == [
                layout.shard_block_bytes(r) for r in range(tp)
            ]
        else:
            assert agents == []


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def test_killing_a_rank_takes_its_worker_down_and_its_member_lapses(stack):
    c = stack.config
    name = "prefill-0" if c.prefill_tp > 1 else "decode-0"
    worker = stack.children[name].proc
    assert worker is not None and worker.poll() is None
    engines = [p for p in child_pids(worker.pid) if "spawn_main" in _cmdline(p)]
    assert len(engines) == 1, engines  # the engine process: rank 0
    ranks = [p for p in child_pids(engines[0]) if "spawn_main" in _cmdline(p)]
    assert len(ranks) == 1, ranks  # rank 1, started by rank 0
    os.kill(ranks[0], signal.SIGKILL)
    t0 = time.monotonic()
    assert worker.wait(timeout=15) == RANK_DIED
    assert time.monotonic() - t0 < 10
    log = stack.children[name].log_path.read_text()
    assert "tensor-parallel rank tandem-rank1" in log and "exited with -9" in log
    role = name.partition("-")[0]
    deadline = time.monotonic() + c.member_ttl + 10
    while name in members(stack).get(role, set()):
        assert time.monotonic() < deadline, f"{name}'s member key outlived its lease"
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
