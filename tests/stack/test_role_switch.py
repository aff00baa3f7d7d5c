"""Run-time role switching on real processes (`services.worker.switch`): a --switchable decode
worker running streams is told by `tandem role` to serve prefill; its streams finish or move
with their KV, nothing fails, the process (and its engine) stays the same, and the router then
sends prompts to it for prefill and no longer decodes there. And the same move made by the
router's role balancer from its pool planner's plan of prompt-heavy traffic (no operator)."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from tandem.v1 import common_pb2, worker_pb2_grpc

from libkv.cluster.registry import MemberWatcher
from libkv.cluster.roles import RoleOrder, RoleOrders
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack_probe import sample_of

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


def two_decode_workers(smol_dir, tmp_path, **options) -> StackConfig:
    """A stack of two decode workers and no prefill worker, long prompts (32+ tokens) sent to
    the prefill pool once there is one (the length rule), fast membership, gRPC KV."""
    return StackConfig(
        model_dir=str(smol_dir), run_dir=str(tmp_path), port=free_port(), num_prefill=0,
        num_decode=2, member_ttl=3, member_refresh=0.5, kv_transport="grpc",
        disagg_mode="length", decode_only_threshold=32, **options,
    )  # fmt: skip


@pytest.mark.stack
@pytest.mark.timeout(420)
def test_decode_worker_switches_to_prefill_under_load(smol_dir, tmp_path) -> None:
    config = two_decode_workers(
        smol_dir, tmp_path, metrics=False, worker_args=("--switchable", "--drain-timeout", "90")
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


# --- The planner, not an operator, moves a worker ------------------------------------------------
SHORT = 4  # completion tokens: a prompt-heavy load, so the planner wants prefill capacity
PLAN = ("prefill_fraction", "prefill_rate_tokens_per_second", "decode_rate_tokens_per_second")


def distinct_prompt(i: int) -> str:
    """About 250 tokens that differ from the first block on (no prefix cache hit)."""
    return f"Log {i}. " + " ".join(
        f"Item {j}: crate {i * 31 + j} of batch {i} went to dock {(i + j) % 7}." for j in range(13)
    )


class Traffic:
    """``senders`` threads sending distinct long prompts back to back, each with ``SHORT``
    completion tokens, recording every outcome (the tokens it got, or the error's repr)."""

    def __init__(self, client: openai.OpenAI, senders: int) -> None:
        self.client, self.stop = client, threading.Event()
        # (start, end, completion tokens or the error) of every request, by time.monotonic()
        self.outcomes: list[tuple[float, float, int | str]] = []
        self._next = itertools.count()
        self._threads = [threading.Thread(target=self._send) for _ in range(senders)]
        for t in self._threads:
            t.start()

    def _send(self) -> None:
        while not self.stop.is_set():
            i, t0 = next(self._next), time.monotonic()
            try:
                out = self.client.completions.create(
                    model=MODEL, prompt=distinct_prompt(i), max_tokens=SHORT, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                self.outcomes.append((t0, time.monotonic(), out.usage.completion_tokens))
            except Exception as e:  # every failure is kept, and fails the test
                self.outcomes.append((t0, time.monotonic(), repr(e)))

    def wait_done(self, since: float, n: int, within: float) -> None:
        """Wait until ``n`` requests sent after ``since`` have ended."""
        deadline = time.monotonic() + within
        while sum(t0 >= since for t0, _, _ in list(self.outcomes)) < n:
            assert time.monotonic() < deadline, f"{n} requests after the switch took {within} s"
            time.sleep(0.2)

    def finish(self) -> list[tuple[float, float, int | str]]:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=240)
        return list(self.outcomes)


def planner_order(endpoint: str, within: float) -> tuple[str, RoleOrder]:
    """Wait for the role balancer's first order; (worker id, order)."""

    async def wait() -> tuple[str, RoleOrder]:
        orders = RoleOrders(endpoint)
        try:
            deadline = time.monotonic() + within
            while not (found := await orders.list()):
                assert time.monotonic() < deadline, f"the planner wrote no order in {within} s"
                await asyncio.sleep(0.2)
            assert len(found) == 1, found  # one move per round, none while one is under way
            return next(iter(found.items()))
        finally:
            await orders.close()

    return asyncio.run(wait())


@pytest.mark.stack
@pytest.mark.timeout(400)
def test_the_planner_moves_a_worker_to_the_pool_the_traffic_needs(smol_dir, tmp_path) -> None:
    config = two_decode_workers(
        smol_dir, tmp_path,
        switch_roles=True,
        worker_args=("--drain-timeout", "90"),
        router_args=("--balance-interval", "1", "--role-min-dwell", "0",
                     "--role-hysteresis", "0"),
    )  # fmt: skip
    with Stack(config) as stack:
        endpoint = stack.etcd.endpoint
        names = ("decode-0", "decode-1")
        pids = {n: stack.children[n].proc.pid for n in names}  # type: ignore[union-attr]
        before = {n: wait_role(endpoint, n, "decode", 10) for n in names}
        router = stack.scrape_targets()["router"]
        assert sample_of(router, "tandem_router_role_orders_total") == 0  # no plan, no move
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=240)
        traffic = Traffic(client, senders=2)
        try:
            moved, order = planner_order(endpoint, 120)
            t_order = time.monotonic()
            plan = {k: sample_of(router, f"tandem_planner_{k}") for k in PLAN}
            after = wait_role(endpoint, moved, "prefill", 120)
            switched = time.monotonic()
            prefilled = stats(stack.children[moved].address, "Prefill").prompt_tokens
            traffic.wait_done(switched, 2, 180)  # the traffic goes on with the new split
        finally:
            outcomes = traffic.finish()
        assert order.role == "prefill" and order.by == "planner"
        # A real plan, from measured rates (a figure not known yet is not exported), that wants
        # more than the floor of one prefill worker gives: over 0.5 of the 2 workers.
        assert plan["prefill_rate_tokens_per_second"] > 0, plan
        assert plan["decode_rate_tokens_per_second"] > 0, plan
        assert plan["prefill_fraction"] * 2 > 0.5, plan
        bad = [o for _, _, o in outcomes if o != SHORT]
        assert not bad, f"{len(bad)} of {len(outcomes)} requests failed: {bad[:3]}"
        assert any(t0 < t_order < t1 for t0, t1, _ in outcomes), "none in flight at the order"

        child = stack.children[moved]
        assert child.proc is not None and child.proc.poll() is None
        assert child.proc.pid == pids[moved] and after != before[moved]  # same process, new side
        stayed = next(n for n in names if n != moved)
        assert wait_role(endpoint, stayed, "decode", 5) == before[stayed]
        # The long prompts sent after the switch were prefilled on the moved worker, the only
        # prefill worker (and decoded on the other).
        now = stats(child.address, "Prefill")
        assert now.role == "prefill" and now.worker_id == moved
        assert now.prompt_tokens >= prefilled + 2 * 200
        # The metrics tell the same story.
        worker = stack.scrape_targets()[moved]
        switches = "tandem_worker_role_switches_total"
        assert sample_of(worker, switches, from_role="decode", to_role="prefill") == 1
        assert sample_of(worker, switches) == 1
        assert sample_of(worker, "tandem_worker_role", role="prefill") == 1
        assert sample_of(stack.scrape_targets()[stayed], switches) == 0
        assert sample_of(router, "tandem_router_role_orders_total", role="prefill") == 1
        assert sample_of(router, "tandem_router_role_orders_total") == 1  # one move, no flapping
