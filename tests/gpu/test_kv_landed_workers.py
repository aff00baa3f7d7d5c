"""The decode worker's KV right after a hand-off from a real prefill worker process is the
sender's, byte for byte, on the path the decode worker takes: its `DecodeCore` with the
transport `decode_side` builds from its config (as ``services.decode``'s wiring does, checksums
on), in this process so the test reads its pool; the prefill worker is a
``services.prefill`` process, whose pool is read out of that process (``/proc/PID/mem`` at the
region its NIXL agent publishes, on CPU; its pool exported for CUDA IPC, mapped here, on a
GPU). Each fetch is compared as soon as it returns, before the decode worker writes into the
blocks, every block including the last, partial one; a first prompt moves all its blocks, a
second that extends it only those the decode worker does not cache.

- ``cpu-nixl-read``: host memory over NIXL READ (UCX on loopback);
- ``cuda-ipc`` (``pytest -m gpu``): both workers on one GPU, the KV moved by CUDA IPC with the
  fused copy-and-check: the path on which a copy that left its destination unwritten once
  passed the serving tests (``tests/gpu/test_serving_gpu.py`` compares tokens, not blocks)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.bundled import DEFAULT_DIR
from engine.core.client import EngineClient
from engine.shapes import write_shape
from libkv.transfer import CUDA_IPC_KEY
from libkv.transfer.nixl_agent import nixl_available
from libkv.transfer.setup import decode_side
from services.decode.core import DecodeCore, DecodeJob
from services.launcher.etcd import EtcdServer
from services.router.calls import RouteJob
from services.router.codec import GrpcWorkerClients
from services.worker.runtime import engine_pool
from tests.landed_cases import member_extras, process_blocks
from tests.stack.test_kv_failover import KV_BYTES, PrefillProc

TOKENIZER = Path(os.environ.get("TANDEM_TOKENIZER_DIR", DEFAULT_DIR))
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# (device, --kv-transport of both workers, --nixl-mode of the decode worker, the path taken)
CASES = [
    pytest.param(
        ("cpu", "nixl", "read", "nixl-read"), id="cpu-nixl-read",
        marks=pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
    ),
    pytest.param(
        ("cuda", "grpc", "auto", "cuda-ipc"), id="cuda-ipc",
        marks=[pytest.mark.gpu,
               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]  # fmt: skip
Read = Callable[[list[int]], np.ndarray]


class Compared:
    """The decode worker's transport, with each fetch's destination blocks compared with the
    sender's source blocks as soon as the fetch returns."""

    def __init__(self, inner, sender: Read, receiver: Read) -> None:
        self.inner, self.sender, self.receiver = inner, sender, receiver
        self.fetches: list[tuple[str, int, list[str]]] = []  # (path, blocks, wrong ones)

    async def fetch(self, request_id, source, src_blocks, dst_blocks, timeout) -> str:
        path = await self.inner.fetch(request_id, source, src_blocks, dst_blocks, timeout)
        src, dst = list(src_blocks), list(dst_blocks)
        got, want = self.receiver(dst), self.sender(src)
        wrong = [
            f"{d} (from {s}): " + ("unwritten" if (g == 0).all() else f"{(g != w).sum()} bytes off")
            for s, d, g, w in zip(src, dst, got, want, strict=True)
            if not np.array_equal(g, w)
        ]
        self.fetches.append((path, len(src), wrong))
        return path

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.fixture(params=CASES)
def case(request):
    return request.param


def test_the_decode_workers_kv_after_a_handoff_is_the_senders(case, tmp_path) -> None:
    device, transport, mode, path = case
    model = write_shape("smollm2-135m", tmp_path / "model", TOKENIZER)
    etcd = EtcdServer(tmp_path / "etcd").start()
    extra = ("--load-format", "dummy", "--gpu-memory-utilization", "0.2", "--device", device,
             "--max-model-len", "2048")  # fmt: skip  # (a GPU worker refuses a pool too small)
    prefill = PrefillProc(model, etcd, "p0", tmp_path, transport, extra)
    try:
        sender = sender_blocks(device, prefill, etcd)
        fetches, counts = _handoffs(device, transport, mode, model, etcd, prefill, sender)
    finally:
        prefill.proc.terminate()
        prefill.proc.wait(30)
        etcd.close()
    assert [p for p, _, _ in fetches] == [path, path]
    assert [wrong for _, _, wrong in fetches] == [[], []]
    first, second = (n for _, n, _ in fetches)
    assert first >= 20 and 0 < second < first + 20  # the second moved only what was missing
    assert counts == {"recomputed": 0, "corrupt_blocks": 0, "transfer_failures": 0}


def sender_blocks(device: str, prefill: PrefillProc, etcd: EtcdServer) -> Read:
    """Reads blocks of the prefill worker's pool from outside it."""
    extra = member_extras(etcd.endpoint)["p0"]
    if device == "cpu":
        return lambda ids: process_blocks(prefill.proc.pid, extra)[ids]
    from libkv.transfer.cuda_ipc import IpcPool, open_pool

    pool = open_pool(IpcPool.from_json(extra[CUDA_IPC_KEY]), torch.device("cuda"))
    return lambda ids: pool[ids].cpu().numpy()


def _handoffs(device, transport, mode, model, etcd, prefill, sender) -> tuple[list, dict]:
    """Two hand-offs into an in-process decode worker; its fetches as compared, its counts."""
    import asyncio

    config = EngineConfig(
        model_dir=str(model), load_format="dummy", kv_cache_bytes=KV_BYTES, device=device,
        gpu_memory_utilization=0.2, max_model_len=2048,
    )  # fmt: skip
    eng = LLMEngine(config)
    pool = eng.runner.kv_pool

    def receiver(ids: list[int]) -> np.ndarray:
        return pool.view(torch.uint8).view(pool.shape[0], -1)[ids].cpu().numpy()

    lines = (f"Line {i}: the warehouse shipped {i * 7} crates to dock {i % 5}." for i in range(40))
    tokens = eng.tokenizer.encode(" ".join(lines))
    assert len(tokens) >= 700
    prompts = [tokens[:340], tokens[:700]]  # 21 blocks and a partial; 43 and a partial

    async def main() -> tuple[list, dict]:
        engine = await EngineClient.local(eng)
        inc = uuid.uuid4().hex
        kv = await decode_side(
            transport, mode, engine_pool(engine), "dec", inc, (etcd.endpoint,),
            layout=eng.runner.layout, checksums=True,
        )  # fmt: skip
        assert kv.transport is not None
        compared = Compared(kv.transport, sender, receiver)
        core = DecodeCore(engine, compared, "dec", inc, transfer_timeout=30.0)  # type: ignore[arg-type]
        clients = GrpcWorkerClients()
        try:
            for i, prompt in enumerate(prompts):
                reply = await clients.prefill(prefill.member(), RouteJob(f"r{i}", prompt, GREEDY))
                assert reply.handle is not None
                job = DecodeJob(f"r{i}", prompt, GREEDY, kv=reply.handle,
                                first_token=reply.first.token_ids[0])  # fmt: skip
                outs = [o async for o in core.generate(job)]
                assert outs[-1].finished and len(outs[-1].token_ids) == GREEDY.max_tokens
            counts = {
                "recomputed": core.recomputed, "corrupt_blocks": core.corrupt_blocks,
                "transfer_failures": core.transfer_failures,
            }  # fmt: skip
            return compared.fetches, counts
        finally:
            await clients.close()
            await kv.close()
            engine.stop()

    return asyncio.run(main())
