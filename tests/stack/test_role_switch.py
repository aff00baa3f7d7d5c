"""Run-time role switching on real processes (`services.worker.switch`): a --switchable decode
worker running streams is told by `tandem role` to serve prefill; its streams finish or move
with their KV, nothing fails, the process (and its engine) stays the same, and the router then
sends prompts to it for prefill and no longer decodes there."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from tandem.v1 import common_pb2, worker_pb2_grpc

from libkv.cluster.registry import MemberWatcher
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig

MODEL = "SmolLM2-135M-Instruct"
TOKENS = 48
LONG = " ".join(f"Line {i}: the ship carried {i * 3} boxes to port {i % 4}." for i in range(12))


def stats(address: str, service: str) -> common_pb2.WorkerStats:
    async def call() -> common_pb2.WorkerStats:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = getattr(worker_pb2_grpc, f"{service}Stub")(ch)
            return await stub.Stats(common_pb2.StatsRequest(), timeout=10)

    return asyncio.run(call())


def wait_role(endpoint: str, worker: str, role: str, within: float) -> str:
    """Wait until ``worker`` is registered (not draining) as ``role``; its incarnation."""

    async def wait() -> str:
        watcher = await MemberWatcher.start(endpoint)
        try:
            ok = await watcher.wait_for(
                lambda ms: worker in ms and ms[worker].role == role and not ms[worker].draining,
                within,
            )
            assert ok, f"{worker} did not become a {role} worker within {within} s"
            return watcher.members[worker].incarnation
        finally:
            await watcher.stop()

    return asyncio.run(wait())


@pytest.mark.stack
@pytest.mark.timeout(420)
def test_decode_worker_switches_to_prefill_under_load(smol_dir, tmp_path) -> None:
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path),
        port=free_port(),
        num_prefill=0,
        num_decode=2,
        member_ttl=3,
        member_refresh=0.5,
        kv_transport="grpc",
        metrics=False,
        disagg_mode="length",
        decode_only_threshold=32,
        worker_args=("--switchable", "--drain-timeout", "90"),
    )
    with Stack(config) as stack:
        child = stack.children["decode-1"]
        assert child.proc is not None
        pid, address = child.proc.pid, child.address
        before = wait_role(stack.etcd.endpoint, "decode-1", "decode", 10)
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=240)

        def one(i: int) -> int:
            out = client.completions.create(
                model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=TOKENS,
                temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return out.usage.completion_tokens

        with ThreadPoolExecutor(6) as pool:
            load = [pool.submit(one, i) for i in range(6)]
            deadline = time.monotonic() + 60
            while stats(address, "Decode").running < 1:  # streams run on decode-1
                assert time.monotonic() < deadline, "decode-1 never ran a stream"
                time.sleep(0.1)
            told = subprocess.run(
                [sys.executable, "-m", "cli", "role", "decode-1", "prefill",
                 "--etcd", stack.etcd.endpoint],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert told.returncode == 0, told.stderr
            after = wait_role(stack.etcd.endpoint, "decode-1", "prefill", 120)
            assert [f.result(timeout=240) for f in load] == [TOKENS] * 6  # nothing dropped

        assert child.proc.poll() is None and child.proc.pid == pid  # the same process
        assert after != before  # a new incarnation: a new KV side
        with open(child.log_path) as f:
            assert "worker decode-1 serves prefill" in f.read()
        now = stats(address, "Prefill")
        assert now.role == "prefill" and now.worker_id == "decode-1"
        # Long prompts are now prefilled on decode-1, the only prefill worker, and decoded on
        # decode-0; decode-1 no longer decodes.
        outs = [
            client.completions.create(model=MODEL, prompt=f"{LONG} #{i}", max_tokens=4)
            for i in range(3)
        ]
        assert [o.usage.completion_tokens for o in outs] == [4] * 3
        later = stats(address, "Prefill")
        assert later.prompt_tokens >= now.prompt_tokens + 3 * 100
        with pytest.raises(grpc.RpcError) as refused:
            stats(address, "Decode")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "serves prefill" in (refused.value.details() or "")
