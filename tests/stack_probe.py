"""What fault, hostile-input and soak tests need around a running local stack: worker Stats
over gRPC (block counts and ``check_integrity()``), the member view in etcd, process RSS, and a
load generator that accounts for every request it sends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx
from tandem.v1 import common_pb2, worker_pb2_grpc

from libkv.cluster.registry import MemberWatcher
from services.launcher.stack import Stack

ERROR_KEYS = {"message", "type", "param", "code"}
WORKER_ROLES = ("prefill", "decode")


# --- Workers and members --------------------------------------------------------------------
def metrics_of(address: str) -> dict[str, float]:
    """A process's Prometheus samples by name, summed over their labels (``transport``,
    ``position``...; component, model and worker are one value per process)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def sample_of(address: str, name: str, **labels: str) -> float:
    """The sum of a process's ``name`` samples whose labels include ``labels`` (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def live_workers(stack: Stack) -> dict[str, str]:
    """name -> address of every worker process that is running."""
    return {
        name: child.address
        for name, child in stack.children.items()
        if name.startswith(WORKER_ROLES) and child.proc is not None and child.proc.poll() is None
    }


def worker_stats(stack: Stack) -> dict[str, common_pb2.WorkerStats]:
    """The Stats RPC of every live worker."""

    async def query() -> dict[str, common_pb2.WorkerStats]:
        out = {}
        for name, address in live_workers(stack).items():
            async with grpc.aio.insecure_channel(address) as ch:
                stub = (
                    worker_pb2_grpc.PrefillStub(ch)
                    if name.startswith("prefill")
                    else worker_pb2_grpc.DecodeStub(ch)
                )
                out[name] = await stub.Stats(common_pb2.StatsRequest(), timeout=10)
        return out

    return asyncio.run(query())


def wait_running(stack: Stack, name: str, within: float) -> None:
    """Block until worker ``name`` runs a request, so a fault injected next hits work."""
    deadline = time.monotonic() + within
    while worker_stats(stack)[name].running < 1:
        assert time.monotonic() < deadline, f"{name} never ran a request"
        time.sleep(0.05)


def busy(stats: common_pb2.WorkerStats) -> bool:
    return bool(stats.kv_blocks_used or stats.held_requests or stats.running or stats.queue_length)


def assert_no_leaks(stack: Stack, within: float = 5.0) -> dict[str, common_pb2.WorkerStats]:
    """Once idle, every live worker holds no blocks and no requests, and its block pool passes
    ``check_integrity()`` (free + used + cached == total, reference counts match the tables)."""
    deadline = time.monotonic() + within
    while True:
        stats = worker_stats(stack)
        left = {
            n: f"used={s.kv_blocks_used} held={s.held_requests} running={s.running} "
            f"waiting={s.queue_length}"
            for n, s in stats.items()
            if busy(s)
        }
        if not left:
            bad = [n for n, s in stats.items() if not s.integrity_ok]
            assert not bad, f"check_integrity() failed on {bad}"
            return stats
        assert time.monotonic() < deadline, f"blocks or requests leaked: {left}"
        time.sleep(0.1)


def members(stack: Stack) -> dict[str, set[str]]:
    """role -> ids of the members etcd lists now (the view a router builds)."""

    async def read() -> dict[str, set[str]]:
        watcher = await MemberWatcher.start([stack.etcd.endpoint])
        try:
            out: dict[str, set[str]] = {}
            for member in watcher.members.values():
                out.setdefault(member.role, set()).add(member.worker_id)
            return out
        finally:
            await watcher.stop()

    return asyncio.run(read())


def wait_members(
    stack: Stack, check: Callable[[dict[str, set[str]]], bool], within: float
) -> tuple[float, dict[str, set[str]]]:
    """Poll the member view until ``check`` holds; returns (seconds it took, the view)."""
    t0 = time.monotonic()
    while True:
        view = members(stack)
        if check(view):
            return time.monotonic() - t0, view
        assert time.monotonic() - t0 < within, f"member view did not heal in {within} s: {view}"
        time.sleep(0.2)


def wait_serving(url: str, model: str, within: float) -> float:
    """Poll a one-token completion until the gateway answers 200; returns the seconds it took
    (a restarted router is reached once the gateway's channel reconnects)."""
    t0 = time.monotonic()
    body = {"model": model, "prompt": "Hi", "max_tokens": 1}
    while True:
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            if r.status_code == 200:
                return time.monotonic() - t0
            detail = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            detail = repr(e)
        assert time.monotonic() - t0 < within, f"not serving after {within} s: {detail}"
        time.sleep(0.2)


def rss_mib(pid: int) -> float:
    """Resident set size of a process, in MiB (from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# --- Load ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One request's fate. ``result``: "ok", "error" (an HTTP error or an SSE error event, both
    OpenAI error JSON), "cancelled" (the client left on purpose), "dropped" (the connection
    broke), "refused" (nothing listened), "timeout" (no answer within the bound: a hang) or
    "malformed" (an answer that is none of these)."""

    path: str
    stream: bool
    started: float
    result: str = ""
    status: int | None = None
    detail: str = ""
    seconds: float = 0.0
    tokens: int = 0  # completion tokens reported in usage
    asked: int = 0  # max_tokens of the request


@dataclass(slots=True)
class LoadSpec:
    url: str
    concurrency: int = 4
    bound_s: float = 90.0  # a request unanswered this long is a hang
    cancel_prob: float = 0.0
    seed: int = 0
    make: Callable[[random.Random], tuple[str, dict]] = field(default=lambda r: ("", {}))


class Load:
    """Closed-loop load from ``concurrency`` clients in a background thread; ``stop`` lets the
    requests in flight finish (or hit the bound) and returns every outcome."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join(self.spec.bound_s + 30)
        assert not self._thread.is_alive(), "load did not stop: a request hangs"
        return list(self.outcomes)

    def wait_for(self, n_ok: int, within: float) -> None:
        """Block until ``n_ok`` requests have completed."""
        deadline = time.monotonic() + within
        while sum(o.result == "ok" for o in self.outcomes) < n_ok:
            assert time.monotonic() < deadline, f"no progress: {summary(self.outcomes)}"
            time.sleep(0.1)

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.spec.concurrency * 2)
        timeout = httpx.Timeout(self.spec.bound_s, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.spec.concurrency)))

    async def _client(self, http: httpx.AsyncClient, index: int) -> None:
        rng = random.Random(self.spec.seed * 1000 + index)
        while not self._stop.is_set():
            path, body = self.spec.make(rng)
            out = Outcome(path, bool(body.get("stream")), time.monotonic())
            out.asked = int(body.get("max_tokens") or 0)
            cancel_after = rng.uniform(0.05, 1.5) if rng.random() < self.spec.cancel_prob else None
            try:
                await asyncio.wait_for(
                    self._send(http, out, path, body, cancel_after), self.spec.bound_s
                )
            except TimeoutError:
                out.result = "timeout"
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                out.result, out.detail = "refused", repr(e)
                await asyncio.sleep(0.2)
            except httpx.HTTPError as e:
                out.result, out.detail = "dropped", repr(e)
            out.seconds = time.monotonic() - out.started
            self.outcomes.append(out)
            if out.result == "error":  # as a client would, instead of hammering at once
                await asyncio.sleep(0.25)

    async def _send(self, http, out: Outcome, path: str, body: dict, cancel_after) -> None:
        url = self.spec.url + path
        if cancel_after is not None:
            try:
                await asyncio.wait_for(self._send(http, out, path, body, None), cancel_after)
            except TimeoutError:
                out.result, out.detail = "cancelled", f"after {cancel_after:.2f} s"
            return
        if not out.stream:
            r = await http.post(url, json=body)
            out.status = r.status_code
            _classify_json(out, r)
            return
        async with http.stream("POST", url, json=body) as r:
            out.status = r.status_code
            out.detail = r.headers.get("x-request-id", "")  # kept if it ends in a timeout
            if r.status_code != 200:
                await r.aread()
                _classify_json(out, r)
                return
            await _classify_sse(out, r)


def _classify_json(out: Outcome, r: httpx.Response) -> None:
    try:
        data = r.json()
    except ValueError:
        out.result, out.detail = "malformed", r.text[:200]
        return
    if r.status_code == 200 and "choices" in data:
        out.result, out.tokens = "ok", data.get("usage", {}).get("completion_tokens", 0)
    elif r.status_code >= 400 and set(data.get("error", {})) >= ERROR_KEYS:
        out.result, out.detail = "error", f"{r.status_code} {data['error']['message']}"
    else:
        out.result, out.detail = "malformed", r.text[:200]


async def _classify_sse(out: Outcome, r: httpx.Response) -> None:
    done = False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            done = True
            break
        event = json.loads(payload)
        if "error" in event:
            assert set(event["error"]) >= ERROR_KEYS, event
            out.result, out.detail = "error", f"stream: {event['error']['message']}"
        elif event.get("usage"):
            out.tokens = event["usage"]["completion_tokens"]
    if not done:
        out.result, out.detail = "dropped", f"stream ended without [DONE] {out.detail}"
    elif not out.result:
        out.result = "ok"


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.result] = counts.get(o.result, 0) + 1
    return counts


def errors(outcomes: list[Outcome]) -> list[str]:
    return [f"{o.result}: {o.status} {o.detail}" for o in outcomes if o.result != "ok"]


def record(test: str, **data: object) -> None:
    """Append one JSON line about a run to the file ``TANDEM_TEST_REPORT`` names (if any): what
    the slow runs recorded in ``bench/results/`` are made of."""
    path = os.environ.get("TANDEM_TEST_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "time": time.time(), **data}) + "\n")


@contextlib.contextmanager
def load(spec: LoadSpec):
    """``with load(spec) as l:`` runs the load for the block; ``l.outcomes`` holds all after."""
    runner = Load(spec).start()
    try:
        yield runner
    finally:
        runner.stop()
