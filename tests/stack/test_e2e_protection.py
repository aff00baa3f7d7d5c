"""End to end, real etcd + services + the bundled model: overload gives fast 429s with
Retry-After while admitted requests finish, batch is shed before interactive, a passed deadline
is a 504 (or an error event) and its blocks are freed at once, tenants are metered in tokens
with the rate-limit headers, one tenant's prefix never hits another's cache, nothing listens
beyond loopback; and a second stack whose every hop is mutual TLS (etcd included)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc

from services.common.tls import TLSFiles
from services.common.tls import channel as tls_channel
from services.gateway.keys import entry
from services.launcher.etcd import EtcdTLS, free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack.test_e2e_stack import LONG, MODEL, assert_all_free
from tests.tls_certs import TestCA

KEY_A, KEY_B, KEY_LIMITED = "sk-tenant-a", "sk-tenant-b", "sk-limited"
INTERNAL_KEY = "sk-internal"
MAX_PENDING = 300  # tokens (prompt + max_tokens) a decode worker accepts at once
RATE_TOKENS = 300  # the limited tenant's tokens per (long) window


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("protect")
    keys = run / "keys.json"
    limited = entry(KEY_LIMITED, "lim", tokens=RATE_TOKENS, requests=100, window=3600)
    entries = [entry(KEY_A, "acme"), entry(KEY_B, "beta"), limited]
    keys.write_text(json.dumps({"keys": entries}))
    config = one_decode_worker(
        smol_dir,
        run,
        worker_args=("--max-pending-tokens", str(MAX_PENDING)),
        gateway_args=("--api-keys-file", str(keys), "--max-request-timeout", "60"),
    )
    with Stack(config) as s:
        yield s


def one_decode_worker(smol_dir: Path, run: Path, **kw) -> StackConfig:
    """A small stack: router, gateway and one decode worker (short prompts go decode-only)."""
    return StackConfig(model_dir=str(smol_dir), run_dir=str(run), port=free_port(),
                       num_prefill=0, num_decode=1, kv_transport="grpc", **kw)  # fmt: skip


def post(stack: Stack, body: dict, key: str = KEY_A, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=timeout)  # fmt: skip


def long_running(stack: Stack, max_tokens: int) -> tuple[threading.Thread, dict, threading.Event]:
    """Stream a request of ``max_tokens`` in a thread; the event is set at its first chunk."""
    started, out = threading.Event(), {}
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip

    def run() -> None:
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY_A}"}) as r:  # fmt: skip
            out["status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                started.set()
                if line:
                    lines.append(line)
            out["lines"] = lines
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out, started


@pytest.mark.stack  # the load: `make test-stack`
def test_overload_is_a_fast_429_batch_first_while_admitted_requests_finish(stack):
    thread, out, started = long_running(stack, 200)  # books ~205 of the worker's 300 tokens
    assert started.wait(60) and out.get("status", 200) == 200
    t0 = time.monotonic()
    too_big = post(stack, {"prompt": "Hello", "max_tokens": 150})
    elapsed = time.monotonic() - t0
    assert too_big.status_code == 429, too_big.text
    assert elapsed < 5, f"the refusal took {elapsed:.1f} s"  # no waiting: refused at once
    err = too_big.json()["error"]
    assert err["code"] == "server_overloaded" and err["type"] == "rate_limit_error"
    assert int(too_big.headers["Retry-After"]) >= 1
    assert int(too_big.headers["retry-after-ms"]) >= 100
    # Batch is shed at half the bound; an interactive request of the same size still fits.
    batch = post(stack, {"prompt": "Hello", "max_tokens": 10, "priority": "batch"})
    assert batch.status_code == 429, batch.text
    small = post(stack, {"prompt": "Hello", "max_tokens": 10, "priority": "interactive"})
    assert small.status_code == 200, small.text
    assert small.json()["usage"]["completion_tokens"] >= 1
    thread.join(120)
    assert out["status"] == 200 and out["lines"][-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(out["lines"])
    assert_all_free(stack, within=5)


def test_deadline_gives_504_and_frees_the_blocks(stack):
    t0 = time.monotonic()
    r = post(stack, {"prompt": "Count:", "max_tokens": 1000, "ignore_eos": True, "timeout": 1.5})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < 6
    assert_all_free(stack, within=3)  # 1000 tokens would hold blocks for a long while
    body = {"prompt": "Count:", "max_tokens": 1000, "ignore_eos": True, "timeout": 2.0,
            "stream": True}  # fmt: skip
    r = post(stack, body)
    assert r.status_code == 200  # the stream had started: the error comes as an event
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "timeout"
    assert_all_free(stack, within=3)


def test_tenant_tokens_are_metered_as_streamed(stack):
    first = post(stack, {"prompt": "Say hi.", "max_tokens": 40}, key=KEY_LIMITED)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-tokens"] == str(RATE_TOKENS)
    assert first.headers["x-ratelimit-limit-requests"] == "100"
    used = first.json()["usage"]["total_tokens"]
    second = post(stack, {"prompt": "Say hi.", "max_tokens": 1}, key=KEY_LIMITED)
    assert second.status_code == 200
    reserved = second.json()["usage"]["prompt_tokens"] + 1
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert abs(remaining - (RATE_TOKENS - used - reserved)) <= 1  # charged what was generated
    over = post(stack, {"prompt": "Say hi.", "max_tokens": RATE_TOKENS - 5}, key=KEY_LIMITED)
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(over.headers["Retry-After"]) > 1 and "x-ratelimit-reset-tokens" in over.headers
    other = post(stack, {"prompt": "Say hi.", "max_tokens": 1}, key=KEY_A)  # not limited
    assert other.status_code == 200 and "x-ratelimit-limit-tokens" not in other.headers


def test_one_tenants_prefix_never_hits_anothers_cache(stack):
    body = {"prompt": LONG[:600], "max_tokens": 1}

    def cached(key: str) -> int:
        r = post(stack, body, key=key)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(KEY_A)
    assert cached(KEY_A) >= 16  # the same tenant hits its own prefix
    assert cached(KEY_B) == 0  # the same prompt from another tenant computes everything


def listening(pid: int) -> set[str]:
    """host:port of every TCP socket ``pid`` listens on (from /proc, IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                host_hex, port_hex = f[1].split(":")
                out.add(f"{_host(host_hex)}:{int(port_hex, 16)}")
    return out


def _host(h: str) -> str:
    """/proc/net/tcp{,6} hex (32-bit words in little-endian order) -> the address as text;
    an IPv4-mapped IPv6 address as its IPv4 form."""
    raw = b"".join(bytes.fromhex(h[i : i + 8])[::-1] for i in range(0, len(h), 8))
    addr = ipaddress.ip_address(raw)
    mapped = getattr(addr, "ipv4_mapped", None)
    return str(mapped or addr)


def test_nothing_listens_beyond_loopback(stack):
    seen = {}
    for name, child in stack.children.items():
        seen[name] = listening(child.pid)
        assert seen[name], f"{name} listens on nothing?"
    seen["etcd"] = listening(stack.etcd.pid)
    wide = {n: a for n, addrs in seen.items() for a in addrs
            if not ipaddress.ip_address(a.rpartition(":")[0]).is_loopback}  # fmt: skip
    assert not wide, f"listening beyond loopback: {wide}"


# --- every hop over mutual TLS -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_stack(smol_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("mtls")
    ca = TestCA(run / "pki")
    certs = {name: ca.issue(name) for name in ("etcd", "router", "decode", "gateway", "probe")}

    def flags(name: str) -> tuple[str, ...]:
        c = certs[name]
        return ("--tls-cert", c.cert, "--tls-key", c.key, "--tls-ca", c.ca,
                "--etcd-ca", c.ca, "--etcd-cert", c.cert, "--etcd-key", c.key)  # fmt: skip

    e = certs["etcd"]
    gw = certs["gateway"]
    config = one_decode_worker(
        smol_dir,
        run,
        etcd_tls=EtcdTLS(e.cert, e.key, e.ca),
        api_keys=(INTERNAL_KEY,),  # the routers check it too: the gateway presents it
        worker_args=flags("decode"),
        router_args=flags("router"),
        gateway_args=("--tls-cert", gw.cert, "--tls-key", gw.key, "--tls-ca", gw.ca),
    )
    with Stack(config) as s:
        yield s, certs


async def _generate(address: str, tls: TLSFiles) -> list:
    async with tls_channel(address, tls) as ch:
        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 2]))
        return [ev async for ev in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=10)]


async def _decode_stats(address: str, tls: TLSFiles | None) -> common_pb2.WorkerStats:
    """Stats of a decode worker, over mutual TLS with ``tls``, else in plaintext."""
    async with tls_channel(address, tls) as ch:
        return await worker_pb2_grpc.DecodeStub(ch).Stats(common_pb2.StatsRequest(), timeout=5)


def test_mutual_tls_stack_serves_and_refuses_clients_without_a_certificate(tls_stack):
    stack, certs = tls_stack
    r = post(stack, {"prompt": "Hello", "max_tokens": 4}, key=INTERNAL_KEY)
    assert r.status_code == 200, r.text  # gateway -> router -> decode, all over mutual TLS
    decode = stack.children["decode-0"].address
    p = certs["probe"]
    stats = asyncio.run(_decode_stats(decode, TLSFiles(p.cert, p.key, p.ca)))
    assert stats.integrity_ok and stats.kv_blocks_used == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a certificate, but no API key
        asyncio.run(_generate(stack.children["router"].address, TLSFiles(p.cert, p.key, p.ca)))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for address in (decode, stack.children["router"].address):
        with pytest.raises(grpc.aio.AioRpcError) as err:  # plaintext, no certificate
            asyncio.run(_decode_stats(address, None))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
