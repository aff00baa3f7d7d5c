"""Mid-stream migration on one GPU (``pytest -m gpu``; run on a GPU host with
``bash bench/device/run.sh tests tests/gpu/test_migration_gpu.py``):
`tests/stack/test_migration.py`'s two
cases with every worker on GPU 0 (its own memory share, CUDA graphs, the real kernels). A
decode worker is killed with ``kill -9``, or drained with SIGTERM, while greedy streams run on
it. The router resumes each of its streams on the other decode worker; a drain moves them with
their KV, which on one host goes GPU to GPU over CUDA IPC (the draining worker's pool mapped
by the survivor). Every client sees one uninterrupted stream with the text and token count of
an uninterrupted run, the survivor recomputes nothing it was handed, and the killed worker
comes back on its GPU. The model is ``engine.shapes``' SmolLM2 shape with seeded dummy
weights in float32, so a stream's tokens do not depend on the batch it shares."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.bundled import DEFAULT_DIR  # noqa: E402
from engine.shapes import write_shape  # noqa: E402
from services.launcher.etcd import free_port  # noqa: E402
from services.launcher.stack import Stack, StackConfig  # noqa: E402
from tests.stack.test_e2e_stack import MODEL, assert_all_free  # noqa: E402
from tests.stack.test_migration import (  # noqa: E402
    PROMPTS,
    STREAMS,
    check_against,
    hit_during_streams,
    metric,
    run_all,
    transfers,
)

TOKENIZER = Path(os.environ.get("TANDEM_TOKENIZER_DIR", DEFAULT_DIR))
DECODE = ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # Served under the name the CPU test's streams ask for (the folder's name).
    model = write_shape("smollm2-135m", tmp_path_factory.mktemp("shape") / MODEL, TOKENIZER)
    config = StackConfig(
        model_dir=str(model), run_dir=str(tmp_path_factory.mktemp("migrate-gpu")),
        port=free_port(), num_prefill=1, num_decode=2, gpus=("0",),
        gpu_memory_utilization=0.15, load_format="dummy", start_timeout=300.0,
        max_num_batched_tokens=512, max_model_len=2048, max_num_seqs=16,
        decode_only_threshold=12, disagg_mode="length", member_ttl=3, member_refresh=1.0,
        worker_args=("--drain-timeout", "3", "--dtype", "float32"),
        router_args=("--policy", "round-robin"),
    )  # fmt: skip
    with Stack(config) as s:
        yield s


@pytest.fixture(scope="module")
def reference(stack):
    out = {s.prompt: s for s in run_all(stack, PROMPTS[:STREAMS])}
    for s in out.values():
        assert s.done and not s.errors, s
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "drain"])
def test_streams_of_a_lost_gpu_decode_worker_continue_elsewhere(stack, reference, sig):
    paths = ("cuda-ipc", "nixl-read", "grpc")
    moved_by = {(n, p): transfers(stack, n, p) for n in DECODE for p in paths}
    recomputed = {n: metric(stack, n, "tandem_kv_handoff_recomputed_total") for n in DECODE}
    moved, live, lost, survivor, gap = hit_during_streams(stack, reference, sig)
    by = {p: transfers(stack, survivor, p) - moved_by[survivor, p] for p in paths}
    print(f"{lost} {signal.Signals(sig).name}: {moved:.0f} migrated, {live:.0f} with their "
          f"KV; the survivor's transfers by path {by}; longest pause between chunks "
          f"{gap:.2f} s")  # fmt: skip
    assert moved >= 1
    log = stack.children[survivor].log_path.read_text()
    assert "arrived corrupt" not in log
    if sig == signal.SIGTERM:
        assert live >= 1
        drained = stack.children[lost].log_path.read_text()
        assert "handed over with their KV" in drained
        assert "drain timed out" not in drained
        # The moved KV came GPU to GPU over CUDA IPC (the draining worker exports its pool),
        # none over NIXL or gRPC, and none was recomputed.
        assert by["cuda-ipc"] >= live and by["nixl-read"] == by["grpc"] == 0, by
        assert metric(stack, survivor, "tandem_kv_handoff_recomputed_total") == recomputed[survivor]
    else:
        assert live == 0
    # The stack keeps serving, and the lost worker comes back on its GPU and serves.
    stack.restart(lost)
    check_against(reference, run_all(stack, PROMPTS[:2]))
    assert_all_free(stack, within=10)
