"""End to end on real processes: the front services carry no torch, the gateway is ready only
once it can route to a live decode worker (and says why not before), and a decode worker that
goes silent (SIGSTOP: its TCP connections stay open, nothing answers) is noticed by the
router's keepalive within seconds, its requests moving to another worker."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig

MODEL = "SmolLM2-135M-Instruct"
TTL = 30  # member lease: far longer than keepalive needs, so only keepalive can explain a move


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory):
    """etcd, a router and the gateway, and no worker yet."""
    run_dir = tmp_path_factory.mktemp("health")
    config = StackConfig(str(smol_dir), str(run_dir), port=free_port(), num_prefill=0,
                         num_decode=0, member_ttl=TTL, router_policy="round-robin")  # fmt: skip
    with Stack(config) as s:
        yield s


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def router_retries(stack: Stack) -> float:
    port = stack.children["router"].metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("tandem_router_retries_total")]
    return float(line.split()[-1])


def complete(client: openai.OpenAI, prompt: str) -> float:
    """Seconds one short completion took (it must succeed)."""
    t0 = time.monotonic()
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    return time.monotonic() - t0


FRONT_IMPORTS = """
import sys
import services.gateway.__main__, services.router.__main__
from engine import SamplingParams  # the package face stays cheap
print(sorted(m for m in ("torch", "engine.llm_engine", "kernels") if m in sys.modules))
"""


def test_front_services_import_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", FRONT_IMPORTS], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_front_services_map_no_torch(stack) -> None:
    for name in ("gateway", "router"):
        assert not maps_torch(stack.children[name].pid), f"{name} maps libtorch"


def test_ready_only_once_a_decode_worker_is_live(stack) -> None:
    r = httpx.get(stack.url + "/health", timeout=10)
    assert r.status_code == 503
    assert "no live decode worker for model " + MODEL in r.json()["reason"]
    assert httpx.get(stack.url + "/livez", timeout=10).status_code == 200
    stack.add_worker("decode")  # returns once the worker printed READY (it is registered)
    t0 = time.monotonic()
    while httpx.get(stack.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() - t0 < 5, "not ready 5 s after a decode worker registered"
        time.sleep(0.1)
    assert httpx.get(stack.url + "/health").json() == {"status": "ok", "models": {MODEL: "ready"}}
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)
    complete(client, "Hello")
    assert maps_torch(stack.children["decode-0"].pid)  # the check above can see torch


@pytest.mark.stack  # a worker stopped with SIGSTOP until keepalive notices: `make test-stack`
@pytest.mark.timeout(300)
def test_silent_worker_is_noticed_by_keepalive_and_its_requests_move(stack) -> None:
    if "decode-0" not in stack.children:
        stack.add_worker("decode")
    stack.add_worker("decode")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)
    for i in range(4):  # round robin: both router -> worker channels are connected
        complete(client, f"Warm up {i}")
    retries = router_retries(stack)
    silent = stack.children["decode-0"].pid
    os.kill(silent, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one lands on the silent one
            took = list(pool.map(lambda i: complete(client, f"Request {i}"), range(2)))
        assert max(took) < 15, took  # seconds (keepalive), not the 60 s deadline or the lease
        assert router_retries(stack) > retries  # moved as on any worker failure
    finally:
        os.kill(silent, signal.SIGCONT)
