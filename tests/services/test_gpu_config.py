"""What each GPU worker is given, checked on the CPU: placement on devices and memory shares,
the worker options `tandem serve` / `tandem bench` pass, the KV pool sizing arithmetic and its
refusals, which hand-off path a pair of workers has, and how routers pair workers by it."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ModelConfig
from engine.errors import InsufficientMemoryError
from engine.memory import DeviceMemory, graph_pool_estimate, plan_cuda, weight_bytes
from engine.shapes import SHAPES, write_shape
from libkv.cluster.registry import Member
from libkv.transfer import (
    CUDA_IPC_KEY,
    DEVICE_KEY,
    HOST_KEY,
    NIXL_GPU_KEY,
    VISIBLE_KEY,
    block_runs,
    handoff_path,
)
from services.launcher.options import add_worker_options, worker_overrides
from services.launcher.placement import cpu_share, parse_gpus, place
from services.launcher.process import Child
from services.launcher.stack import Stack, StackConfig
from services.router.policy import Chooser, PolicyConfig, RouteRequest
from services.worker.config import parse_config

GIB = 1024**3


# -- placement --------------------------------------------------------------------------------
def test_one_gpu_per_worker_then_shared_with_split_shares():
    out = place(["prefill-0", "decode-0", "decode-1"], ("0", "1"))
    assert [p.device for p in out.values()] == ["0", "1", "0"]
    assert out["prefill-0"].visible == ("0", "1") and out["decode-0"].visible == ("1", "0")
    assert out["prefill-0"].utilization == out["decode-1"].utilization == 0.45
    assert out["decode-0"].utilization == 0.9 and out["decode-0"].shared_with == 1
    assert out["decode-0"].env == {"CUDA_VISIBLE_DEVICES": "1,0"}
    assert out["decode-0"].args == ["--gpu-memory-utilization", "0.9"]


def test_explicit_share_and_no_gpus():
    out = place(["prefill-0", "decode-0"], ("3",), utilization=0.3)
    assert {p.utilization for p in out.values()} == {0.3}
    assert out["decode-0"].env == {"CUDA_VISIBLE_DEVICES": "3"}
    cpu = place(["decode-0"], ())
    assert cpu["decode-0"].env == {} and cpu["decode-0"].args == []


def test_tensor_parallel_workers_take_a_gpu_per_rank():
    sizes = {"prefill-0": 2, "decode-0": 1, "decode-1": 1}
    out = place(["prefill-0", "decode-0", "decode-1"], ("0", "1", "2", "3"), sizes=sizes)
    assert out["prefill-0"].devices == ("0", "1") and out["prefill-0"].ranks == ("1",)
    assert out["prefill-0"].env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # rank r on cuda:r
    assert [out[w].devices for w in ("decode-0", "decode-1")] == [("2",), ("3",)]
    assert {p.utilization for p in out.values()} == {0.9}
    # Fewer GPUs than ranks in all: shared, each worker's share set by its busiest device.
    two = place(["prefill-0", "decode-0"], ("0", "1"), sizes={"prefill-0": 2})
    assert two["decode-0"].devices == ("0",) and two["decode-0"].utilization == 0.45
    assert two["prefill-0"].utilization == 0.45
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        place(["decode-0"], ("0", "1"), sizes={"decode-0": 4})


def test_cpu_workers_split_the_hosts_cores(monkeypatch):
    """Without GPUs each engine computes with its share of the cores, at least one thread: two
    engines of a thread per core each, computing at once, stalled each other's OpenMP barriers
    (decode steps about 5x slower); a lone engine keeps torch's default."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = place(["prefill-0", "decode-0", "decode-1"], (), cpus=2)
    assert {p.cpu_threads for p in out.values()} == {1}
    assert out["decode-1"].env == {"OMP_NUM_THREADS": "1"} and out["decode-1"].args == []
    assert {p.cpu_threads for p in place(["decode-0", "decode-1"], (), cpus=16).values()} == {8}
    tp = place(["prefill-0", "decode-0"], (), sizes={"prefill-0": 2}, cpus=6)  # three ranks
    assert tp["decode-0"].env == {"OMP_NUM_THREADS": "2"}
    assert place(["decode-0"], (), cpus=8)["decode-0"].env == {}
    # The operator's own OMP_NUM_THREADS (inherited by every worker) is left as it is.
    assert cpu_share(3, 2, env={"OMP_NUM_THREADS": "4"}) == 0
    assert cpu_share(3, 2, env={}) == 1


def test_parse_gpus():
    assert parse_gpus("0, 2") == ("0", "2")
    assert parse_gpus("none") == ()
    assert parse_gpus("auto", {"CUDA_VISIBLE_DEVICES": "1,3"}) == ("1", "3")
    assert parse_gpus("auto", {"CUDA_VISIBLE_DEVICES": ""}) == ()
    with pytest.raises(ValueError, match="twice"):
        parse_gpus("0,0")


class RecordingStack(Stack):
    """The launcher with process start replaced (this tests what each worker is given): each
    'process' announces READY at once; the start order is recorded."""

    def __init__(self, config: StackConfig) -> None:
        super().__init__(config)
        self.order: list[str] = []

    def _launch(self, child: Child) -> None:
        self.order.append(child.name)
        child.log_path.write_text(f"READY {child.name} 127.0.0.1:1\n")


def test_stack_gives_workers_devices_shares_and_options(tmp_path):
    cfg = StackConfig(
        "/m", str(tmp_path), gpus=("0",), max_num_batched_tokens=2048, max_model_len=4096,
        load_format="dummy", dtype="bfloat16",
    )  # fmt: skip
    stack = RecordingStack(cfg)
    stack._spawn_workers(deadline=float("inf"))
    assert stack.order == ["prefill-0", "decode-0"]  # on one device: one after the other
    for name in stack.order:
        child = stack.children[name]
        argv = child.argv
        assert child.env == {"CUDA_VISIBLE_DEVICES": "0"}
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.45"
        assert argv[argv.index("--max-num-batched-tokens") + 1] == "2048"
        assert argv[argv.index("--max-model-len") + 1] == "4096"
        assert argv[argv.index("--load-format") + 1] == "dummy"
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
        assert "--kv-cache-bytes" not in argv  # sized from the memory share
    # A CPU stack's pools: tests/services/test_kv_budget.py.


def test_serve_and_bench_flags_reach_the_stack_config(tmp_path):
    p = argparse.ArgumentParser()
    add_worker_options(p)
    args = p.parse_args(
        ["--gpus", "0,1", "--gpu-memory-utilization", "0.4", "--num-kv-blocks", "100",
         "--max-model-len", "8192", "--load-format", "dummy", "--kv-cache-mib", "64",
         "--worker-arg=--nixl-mode=read"]
    )  # fmt: skip
    out = worker_overrides(args)
    assert out["gpus"] == ("0", "1") and out["gpu_memory_utilization"] == 0.4
    assert out["num_kv_blocks"] == 100 and out["kv_cache_bytes"] == 64 * 1024**2
    assert out["max_model_len"] == 8192 and out["load_format"] == "dummy"
    assert out["max_num_batched_tokens"] is None  # GPUs: the workers' own default
    assert out["worker_args"] == ("--nixl-mode=read",)
    cfg = StackConfig("/m", "/r", **out)
    assert cfg.placements()["decode-0"].utilization == 0.4
    tp = worker_overrides(p.parse_args(["--gpus", "0,1,2", "--prefill-tp", "2"]))
    cfg = StackConfig("/m", "/r", **tp)
    assert (cfg.prefill_tp, cfg.decode_tp) == (2, 1)
    assert [p.devices for p in cfg.placements().values()] == [("0", "1"), ("2",)]
    stack = Stack(dataclasses.replace(cfg, run_dir=str(tmp_path)))
    argv = stack._worker_args("prefill", 0, cfg.placements()["prefill-0"])
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    with pytest.raises(SystemExit, match="--decode-tp must be >= 1"):
        worker_overrides(p.parse_args(["--gpus", "none", "--decode-tp", "0"]))
    assert "worker_nice" not in worker_overrides(p.parse_args(["--gpus", "none"]))
    nice = worker_overrides(p.parse_args(["--gpus", "none", "--worker-nice", "0"]))
    assert StackConfig("/m", "/r", **nice).worker_nice == 0
    with pytest.raises(SystemExit, match="--worker-nice must be in"):
        worker_overrides(p.parse_args(["--gpus", "none", "--worker-nice", "20"]))


def test_worker_memory_flags_and_their_variables():
    env = {
        "TANDEM_GPU_MEMORY_UTILIZATION": "0.45",
        "TANDEM_NUM_KV_BLOCKS": "77",
        "TANDEM_MAX_MODEL_LEN": "4096",
        "TANDEM_CUDA_IPC": "0",
    }
    config = parse_config("decode", ["--model-dir", "/m"], env)
    engine = config.engine_config()
    assert (engine.gpu_memory_utilization, engine.num_kv_blocks) == (0.45, 77)
    assert engine.max_model_len == 4096 and engine.kv_cache_bytes is None
    assert config.cuda_ipc is False
    flags = ["--model-dir", "/m", "--kv-cache-bytes", "1024", "--cuda-ipc"]
    config = parse_config("decode", flags, env)
    assert config.engine_config().kv_cache_bytes == 1024 and config.cuda_ipc


# -- memory -----------------------------------------------------------------------------------
def memory(weights=16, activations=2, graphs=1, other=1, total=80, free=79.5) -> DeviceMemory:
    return DeviceMemory(
        int(total * GIB), int(free * GIB), int(weights * GIB), int(activations * GIB),
        int(graphs * GIB), int(other * GIB),
    )  # fmt: skip


def test_pool_is_what_the_share_leaves():
    plan = plan_cuda(memory(), 0.45, 2 * 1024**2, 16, 8192)
    assert plan.budget == int(0.45 * 80 * GIB)
    assert plan.num_blocks == (int(0.45 * 80 * GIB) - 20 * GIB) // (2 * 1024**2)
    assert "KV pool" in plan.describe() and "share of 80.00 GiB" in plan.describe()


def test_refusals_give_the_numbers():
    with pytest.raises(InsufficientMemoryError, match=r"131072 tokens \(max_model_len\)"):
        plan_cuda(memory(), 0.3, 2 * 1024**2, 16, 131072)  # 4 GiB left, 16 GiB needed
    with pytest.raises(InsufficientMemoryError, match="requested pool of 100000 blocks"):
        plan_cuda(memory(), 0.45, 2 * 1024**2, 16, 1024, num_kv_blocks=100_000)
    with pytest.raises(InsufficientMemoryError, match="only 30.00 GiB of the device was free"):
        plan_cuda(memory(free=30), 0.45, 2 * 1024**2, 16, 1024)
    explicit = plan_cuda(memory(), 0.45, 2 * 1024**2, 16, 1024, kv_cache_bytes=GIB)
    assert explicit.num_blocks == 512


def test_graph_pool_estimate_covers_what_the_lora_graphs_took():
    """Llama-3.1-8B's decode graphs of 1 to 32 rows, base and LoRA, took 0.23 GiB on an H100
    (lab.lora, 2026-11-24) where counting the logits' bytes set aside 0.19 GiB: each kept
    logits tensor is counted with the allocator segment it may pin."""
    vocab, sizes = 128256, [1, 2, 4, 8, 16, 32]
    lora = graph_pool_estimate(sizes, vocab, 0.0, variants=2)
    assert lora >= 0.23 * GIB
    assert (
        lora - graph_pool_estimate(sizes, vocab, 0.0)
        == graph_pool_estimate(sizes, vocab, 0.0) - 128 * 1024**2
    )
    big = graph_pool_estimate([256], vocab, 0.0) - 128 * 1024**2  # large logits: 2 MiB rounding
    assert 256 * vocab * 4 <= big < 256 * vocab * 4 + 2 * 1024**2


def test_weight_bytes_of_the_shapes():
    c = ModelConfig.from_dict(SHAPES["llama-3.1-8b"])
    assert weight_bytes(c, 2) == 8_030_261_248 * 2  # Llama-3.1-8B's parameter count
    assert weight_bytes(ModelConfig.from_dict(SHAPES["llama-3.2-3b"]), 2) == 3_212_749_824 * 2


def test_shape_folders_load_as_models(tmp_path, smol_dir):
    for name in SHAPES:
        out = write_shape(name, tmp_path / name, smol_dir)
        config = ModelConfig.from_dir(out)
        assert config.num_layers == SHAPES[name]["num_hidden_layers"]
        assert config.eos_token_ids == (2,) and config.bos_token_id == 1  # the tokenizer's
        assert (out / "tokenizer.json").is_file()
    cli = subprocess.run(
        [sys.executable, "-m", "engine.shapes", "qwen2.5-7b", "--out", str(tmp_path / "q"),
         "--tokenizer", str(smol_dir)], capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(cli.stdout.strip()) == tmp_path / "q"


# -- hand-off paths -----------------------------------------------------------------------------
def gpu(host: str, device: str, visible: str = "", nixl: str = "0", ipc: bool = True) -> dict:
    extra = {HOST_KEY: host, DEVICE_KEY: device, VISIBLE_KEY: visible or device, NIXL_GPU_KEY: nixl}
    if ipc:
        extra[CUDA_IPC_KEY] = "{}"
    return extra


def test_handoff_paths():
    assert handoff_path({}, {}) == "network"  # host-memory pools: NIXL or the gRPC stream
    assert handoff_path(gpu("h", "g0"), gpu("h", "g0")) == "cuda-ipc"  # one GPU
    assert handoff_path(gpu("h", "g0"), gpu("h", "g1", "g0,g1")) == "cuda-ipc"  # peer visible
    assert handoff_path(gpu("h", "g0"), gpu("h", "g1")) is None  # not visible, no NIXL
    assert handoff_path(gpu("a", "g0", nixl="1"), gpu("b", "g1", nixl="1")) == "network"
    assert handoff_path(gpu("a", "g0", nixl="1"), gpu("b", "g1", nixl="0")) is None
    assert handoff_path(gpu("h", "g0", ipc=False), gpu("h", "g0")) is None
    assert handoff_path({}, gpu("h", "g0")) is None  # host memory to GPU: never over TCP


def test_block_runs_merge_consecutive_pairs_only():
    assert block_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert block_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [])


class Directory:
    def __init__(self, members: list[Member]) -> None:
        self.members = members

    def members_by_role(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]


def worker(worker_id: str, role: str, extra: dict) -> Member:
    return Member(worker_id, role, "m", f"{worker_id}:1", 1000, 16, f"i-{worker_id}", extra=extra)


@pytest.mark.parametrize("policy", ["kv", "least-loaded", "round-robin"])
def test_routers_disaggregate_only_over_a_gpu_direct_path(policy):
    long = RouteRequest(list(range(2000)), max_tokens=8)
    far = worker("d-far", "decode", gpu("b", "g9"))  # another host, no NIXL
    near = worker("d-near", "decode", gpu("a", "g1", "g0,g1"))
    prefill = worker("p", "prefill", gpu("a", "g0"))
    chooser = Chooser(Directory([prefill, far]), PolicyConfig(policy, 256))
    plan = chooser.plan(long, set())
    assert plan is not None and plan.prefill is None and plan.reason == "decode-only"
    chooser = Chooser(Directory([prefill, far, near]), PolicyConfig(policy, 256))
    for _ in range(4):
        plan = chooser.plan(long, set())
        assert plan is not None
        assert plan.prefill is None or (plan.prefill.worker_id, plan.decode.worker_id) == (
            "p", "d-near",
        )  # fmt: skip
    assert chooser.pick_prefill(long, set(), far) is None
    assert chooser.pick_prefill(long, set(), near) == prefill
