"""The decode worker's KV path against real prefill worker processes over NIXL: token-identical
hand-off, incremental transfer of only the blocks decode does not cache, a prefill worker
killed (-9) around the transfer, and a restarted prefill worker reached through its new agent.

Real etcd and two real prefill workers (``python -m services.prefill``) run as processes; the
decode side (engine, NIXL transport, `DecodeCore`) runs in this process so the test can read
its counters and its pool."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.client import EngineClient
from libkv.cluster.registry import Member
from libkv.transfer import agent_name
from libkv.transfer.nixl_agent import nixl_available
from libkv.transfer.setup import decode_side
from services.common.errors import KVTransferFailed
from services.decode.core import DecodeCore, DecodeJob
from services.launcher.etcd import EtcdServer
from services.router.calls import RouteJob
from services.router.codec import GrpcWorkerClients
from services.worker.runtime import engine_pool

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
GREEDY = SamplingParams(max_tokens=12, temperature=0)
KV_BYTES = 64 * 1024**2


class PrefillProc:
    """One ``services.prefill`` process with the NIXL transport (or ``transport``), and
    ``extra`` flags."""

    def __init__(self, model_dir: Path, etcd: EtcdServer, worker_id: str, log_dir: Path,
                 transport: str = "nixl", extra: tuple[str, ...] = ()):  # fmt: skip
        self.worker_id = worker_id
        self.argv = [
            sys.executable, "-m", "services.prefill", "--model-dir", str(model_dir),
            "--etcd", etcd.endpoint, "--worker-id", worker_id, "--kv-transport", transport,
            "--kv-cache-bytes", str(KV_BYTES), "--member-ttl", "3", "--member-refresh", "1",
            *extra,
        ]  # fmt: skip
        self.log = log_dir / f"{worker_id}.log"
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = self.log.read_text(errors="replace").splitlines()
            ready = [ln for ln in lines if ln.startswith("READY prefill")]
            if len(ready) > self.starts():
                self.address = ready[-1].split()[-1]
                return
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.2)
        raise TimeoutError(f"{self.worker_id} did not start")

    def starts(self) -> int:
        return getattr(self, "_starts", 0)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def restart(self) -> None:
        self._starts = self.starts() + 1
        self.start()

    def member(self) -> Member:
        return Member(self.worker_id, "prefill", "m", self.address)


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("failover")
    etcd = EtcdServer(run / "etcd").start()
    procs = {w: PrefillProc(smol_dir, etcd, w, run) for w in ("p0", "p1")}
    yield etcd, procs
    for p in procs.values():
        if p.proc.poll() is None:
            p.proc.terminate()
            p.proc.wait(20)
    etcd.close()


@pytest.fixture(scope="module")
def offline(smol_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=KV_BYTES))


def reference(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request(f"ref-{time.monotonic_ns()}", prompt, GREEDY)
    final = None
    while engine.has_unfinished():
        final = [o for o in engine.step() if o.finished] or final
    return final[0].token_ids


class Decode:
    """An in-process decode worker: engine, KV transport from config, DecodeCore."""

    def __init__(self, smol_dir, etcd: EtcdServer, mode: str, policy: str = "recompute"):
        self.args = (smol_dir, etcd, mode, policy)

    async def __aenter__(self) -> Decode:
        smol_dir, etcd, mode, policy = self.args
        self.llm = LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=KV_BYTES))
        self.engine = await EngineClient.local(self.llm)
        inc = uuid.uuid4().hex
        pool = engine_pool(self.engine)
        self.kv = await decode_side("nixl", mode, pool, "dec", inc, (etcd.endpoint,))
        assert self.kv.transport.name == f"nixl-{mode}"
        self.core = DecodeCore(self.engine, self.kv.transport, "dec", inc, 5.0, policy)
        self.clients = GrpcWorkerClients()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.clients.close()
        await self.kv.close()
        self.engine.stop()

    async def prefill(self, proc: PrefillProc, rid: str, prompt: list[int]) -> DecodeJob:
        reply = await self.clients.prefill(proc.member(), RouteJob(rid, prompt, GREEDY))
        assert reply.handle is not None
        return DecodeJob(rid, prompt, GREEDY, kv=reply.handle, first_token=reply.first.token_ids[0])

    async def run(self, job: DecodeJob) -> list[int]:
        outs = [o async for o in self.core.generate(job)]
        assert outs[-1].finished
        return outs[-1].token_ids

    def assert_no_leaks(self) -> None:
        eng = self.llm
        eng.check_integrity()
        assert eng.pool.num_used == 0 and not eng.tables.reserved


def long_prompt(offline: LLMEngine, n: int, salt: str) -> list[int]:
    text = " ".join(f"{salt} line {i}: {i * 13 % 97} boxes to bay {i % 7}." for i in range(n))
    return offline.tokenizer.encode(text)


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_handoff_is_token_identical_and_moves_only_missing_blocks(
    cluster, offline, smol_dir, mode
):
    etcd, procs = cluster
    first = long_prompt(offline, 20, mode)
    longer = first + long_prompt(offline, 6, "tail")
    async with Decode(smol_dir, etcd, mode) as d:
        job = await d.prefill(procs["p0"], f"a-{mode}", first)
        assert await d.run(job) == reference(offline, first)
        assert d.core.blocks_pulled == len(job.kv.block_ids)
        # The decode worker now caches the first prompt's full blocks: only the rest move.
        job2 = await d.prefill(procs["p0"], f"b-{mode}", longer)
        before = d.core.blocks_pulled
        assert await d.run(job2) == reference(offline, longer)
        cached_blocks = len(first) // 16
        assert 0 < cached_blocks < len(job2.kv.block_ids)
        assert d.core.blocks_pulled - before == len(job2.kv.block_ids) - cached_blocks
        assert d.core.transport.stats.transfers == 2 and d.core.transfer_failures == 0
        d.assert_no_leaks()


class KillDuringFetch:
    """Wraps a transport: kills the prefill process 1 ms into the next fetch (the copy of tens
    of MiB takes far longer here, so the kill always lands before the data is complete)."""

    def __init__(self, inner, proc: PrefillProc) -> None:
        self.inner, self.proc = inner, proc

    async def fetch(self, *args, **kwargs) -> None:
        task = asyncio.ensure_future(self.inner.fetch(*args, **kwargs))
        await asyncio.sleep(0.001)
        self.proc.kill()
        await task

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.mark.stack  # a killed and restarted prefill worker: `make test-stack`
@pytest.mark.parametrize("mode", ["read", "write"])
async def test_prefill_killed_mid_transfer_recomputes_and_restart_uses_new_agent(
    cluster, offline, smol_dir, mode
):
    etcd, procs = cluster
    p1 = procs["p1"]
    prompt = long_prompt(offline, 50, f"kill-{mode}")  # ~45 blocks, ~33 MiB of KV
    async with Decode(smol_dir, etcd, mode) as d:
        job = await d.prefill(p1, f"k-{mode}", prompt)
        nixl = d.core.transport
        d.core.transport = KillDuringFetch(nixl, p1)
        t0 = time.monotonic()
        assert await d.run(job) == reference(offline, prompt)  # recomputed, first token kept
        assert time.monotonic() - t0 < 60
        assert d.core.transfer_failures == 1 and d.core.recomputed == 1
        assert nixl.stats.failures == 1
        d.assert_no_leaks()

        d.core.transport = nixl
        old_agent = agent_name("p1", job.kv.incarnation)
        p1.restart()  # same worker id, new incarnation, new NIXL agent
        job2 = await d.prefill(p1, f"n-{mode}", prompt)
        assert job2.kv.incarnation != job.kv.incarnation
        assert await d.run(job2) == reference(offline, prompt)
        assert d.core.recomputed == 1  # this time the KV arrived
        endpoint = nixl.network.endpoint  # the NIXL transport behind the path chooser
        assert endpoint.knows(agent_name("p1", job2.kv.incarnation))
        assert not endpoint.knows(old_agent)
        d.assert_no_leaks()


async def test_stale_handle_with_retry_policy_fails_for_the_router(cluster, offline, smol_dir):
    etcd, procs = cluster
    prompt = long_prompt(offline, 20, "stale")
    async with Decode(smol_dir, etcd, "read", policy="retry") as d:
        job = await d.prefill(procs["p0"], "s1", prompt)
        job.kv = dataclasses.replace(job.kv, incarnation="an-old-incarnation")
        with pytest.raises(KVTransferFailed, match="restarted"):
            await d.run(job)
        assert d.core.transfer_failures == 1 and d.core.recomputed == 0
        d.assert_no_leaks()
        assert await d.clients.release(job.kv, "s1") is None  # what the router does next
