"""Mid-stream migration, end to end on real processes: a decode worker is killed with ``kill -9``
(and, second, drained with SIGTERM past its drain timeout) while greedy streams run on it. The
router resumes each of its streams on the other decode worker from the prompt plus the tokens
already sent; every client sees one uninterrupted stream with the text and token count of an
uninterrupted run, and the stack keeps serving."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import httpx
import pytest

from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack.test_e2e_stack import MODEL, TRANSPORTS, assert_all_free
from tests.stack_probe import worker_stats

pytestmark = pytest.mark.stack  # two stacks, a kill and a drain each: `make test-stack`

MAX_TOKENS = 64
STREAMS = 6
PROMPTS = [
    "Write a story about a fox who learns to sail.",
    "Explain how a refrigerator keeps food cold.",
    "List the planets of the solar system and describe each.",
    "Describe a busy morning at a fish market.",
    "What makes a good cup of tea? Explain step by step.",
    "Tell me about the history of the bicycle.",
]


@dataclass(slots=True)
class Stream:
    prompt: str
    text: str = ""
    chunks: int = 0
    tokens: int | None = None  # usage.completion_tokens
    finish: str | None = None
    errors: list[dict] = field(default_factory=list)
    status: int = 0
    done: bool = False
    progress: threading.Event = field(default_factory=threading.Event)  # a few chunks in
    gap: float = 0.0  # longest pause between two chunks, seconds


def run_stream(url: str, s: Stream) -> None:
    body = {"model": MODEL, "prompt": s.prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        s.status = r.status_code
        last = None
        for line in r.iter_lines():
            now = time.monotonic()
            if last is not None and line:
                s.gap = max(s.gap, now - last)
            last = now if line else last
            if line == "data: [DONE]":
                s.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.errors.append(chunk["error"])
                    continue
                if chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    s.text += c["text"]
                    s.finish = c["finish_reason"] or s.finish
                    s.chunks += 1
                    if s.chunks >= 4:
                        s.progress.set()
    s.progress.set()


def run_all(stack: Stack, prompts: list[str], during=None) -> list[Stream]:
    """Stream every prompt at once; ``during()`` runs once all have a few chunks."""
    streams = [Stream(p) for p in prompts]
    url = f"{stack.url}/v1/completions"
    threads = [threading.Thread(target=run_stream, args=(url, s), daemon=True) for s in streams]
    for t in threads:
        t.start()
    if during is not None:
        for s in streams:
            assert s.progress.wait(240)
        during()
    for t in threads:
        t.join(300)
    return streams


def metric(stack: Stack, process: str, name: str) -> float:
    target = stack.scrape_targets()[process]
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name):
                return float(line.split()[-1])
    raise AssertionError(f"no {name} from {process}")


def migrations(stack: Stack) -> tuple[float, float]:
    """The router's migrations, and of those the live moves (KV handed over)."""
    return (metric(stack, "router", "tandem_router_migrations_total"),
            metric(stack, "router", "tandem_router_live_moves_total"))  # fmt: skip


def transfers(stack: Stack, process: str, transport: str) -> float:
    """``tandem_kv_transfers_total`` of one transport label."""
    target = stack.scrape_targets()[process]
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    want = f'transport="{transport}"'
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("tandem_kv_transfers_total") and want in line)  # fmt: skip


@pytest.fixture(scope="module", params=TRANSPORTS)
def stack(smol_dir, tmp_path_factory, request):
    config = StackConfig(
        model_dir=str(smol_dir), run_dir=str(tmp_path_factory.mktemp("migrate")),
        port=free_port(), num_prefill=1, num_decode=2, kv_transport=request.param,
        decode_only_threshold=12,  # longer prompts through the prefill worker, short ones not
        disagg_mode="length",  # placement by length alone, whatever the load
        member_ttl=3, member_refresh=1.0,
        # A drained worker's streams outlive its drain: they move (with their KV) or are cut.
        # The drain waits for the moved KV to be read: 15 s, since on a loaded machine a gRPC
        # pull of it took over 1 s and a 3 s drain timed out (a KV never freed still does).
        worker_args=("--drain-timeout", "15"),
        router_args=("--policy", "round-robin"),  # both decode workers get streams
    )  # fmt: skip
    with Stack(config) as s:
        yield s


@pytest.fixture(scope="module")
def reference(stack) -> dict[str, Stream]:
    """The uninterrupted runs (same stack, same concurrency)."""
    out = {s.prompt: s for s in run_all(stack, PROMPTS[:STREAMS])}
    for s in out.values():
        assert s.done and not s.errors and s.tokens == MAX_TOKENS, s
    return out


def check_against(reference: dict[str, Stream], streams: list[Stream]) -> None:
    for s in streams:
        ref = reference[s.prompt]
        assert s.status == 200 and s.done and not s.errors, (s.prompt, s.errors)
        assert s.text == ref.text, s.prompt  # token-exact: nothing lost, repeated or changed
        assert s.tokens == MAX_TOKENS and s.finish == "length"  # each token counted once


def hit_busiest(stack: Stack, sig: int, hit: list[str]):
    """What to do once every stream is under way: send ``sig`` to the decode worker running
    the most streams (SIGKILL: dies at once; SIGTERM: drains for up to 15 s, then cuts the rest)."""

    def run() -> None:
        stats = worker_stats(stack)
        name = max(("decode-0", "decode-1"), key=lambda n: stats[n].running)
        assert stats[name].running > 0
        hit.append(name)
        stack.kill(name, sig, timeout=30)

    return run


def hit_during_streams(stack: Stack, reference: dict[str, Stream], sig: int):
    """Every prompt streamed at once, ``sig`` sent to the busiest decode worker once all are
    under way (`hit_busiest`), every stream checked against ``reference``. Returns the run's
    migrations and live moves, the worker hit, the survivor and the longest pause between two
    chunks of any stream (seconds)."""
    before = migrations(stack)
    hit: list[str] = []
    streams = run_all(stack, PROMPTS[:STREAMS], during=hit_busiest(stack, sig, hit))
    check_against(reference, streams)
    moved, live = (a - b for a, b in zip(migrations(stack), before, strict=True))
    survivor = "decode-0" if hit[0] == "decode-1" else "decode-1"
    return moved, live, hit[0], survivor, max(s.gap for s in streams)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "drain"])
def test_streams_of_a_lost_decode_worker_continue_elsewhere(stack, reference, sig):
    """Over the gRPC stream both cases; over NIXL the drain (its live moves READ the KV from
    the draining worker's agent; a kill does not depend on the transport)."""
    transport = stack.config.kv_transport
    if transport == "nixl" and sig == signal.SIGKILL:
        pytest.skip("a killed worker's streams are re-prefilled: no KV moves")
    over = {n: (transfers(stack, n, "nixl-read"), transfers(stack, n, "grpc"))
            for n in ("decode-0", "decode-1")}  # fmt: skip
    recomputed = {n: metric(stack, n, "tandem_kv_handoff_recomputed_total")
                  for n in ("decode-0", "decode-1")}  # fmt: skip
    moved, live, lost, survivor, gap = hit_during_streams(stack, reference, sig)
    print(f"{lost} {signal.Signals(sig).name}: {moved:.0f} migrated, {live:.0f} with their "
          f"KV; longest pause between chunks {gap:.2f} s")  # fmt: skip
    assert moved >= 1
    if sig == signal.SIGTERM:  # a planned drain moves the running streams with their KV
        assert live >= 1
        drained = stack.children[lost].log_path.read_text()
        assert "handed over with their KV" in drained
        # Its moved KV was freed once read (NIXL: on the READ's notification), so the drain
        # ended before its timeout.
        assert "drain timed out" not in drained
        # The KV arrived: nothing was recomputed on the worker that took them over.
        after = metric(stack, survivor, "tandem_kv_handoff_recomputed_total")
        assert after == recomputed[survivor]
        nixl = transfers(stack, survivor, "nixl-read") - over[survivor][0]
        grpc = transfers(stack, survivor, "grpc") - over[survivor][1]
        if transport == "nixl":  # READ from the draining worker's agent, no gRPC fallback
            assert nixl >= live and grpc == 0, (nixl, grpc)
        else:
            assert grpc >= live and nixl == 0, (nixl, grpc)
    else:
        assert live == 0
    assert "arrived corrupt" not in stack.children[survivor].log_path.read_text()
    # The stack keeps serving on the survivor, and the lost worker comes back.
    stack.restart(lost)
    check_against(reference, run_all(stack, PROMPTS[:2]))
    assert_all_free(stack, within=10)
