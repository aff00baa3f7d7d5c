"""The main of a tensor-parallel rank process (ranks 1..N-1; rank 0 is the engine's process).

It joins the process group, builds its ``ModelRunner`` over its shard (in step with rank 0's,
which runs the same collectives: the memory profile, the pool size, the CUDA graphs), then
runs every command rank 0 sends until ``stop`` or until rank 0 is gone.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig, ModelConfig
from engine.gil import quick_handoffs
from engine.parallel.comm import TPComm, client_store, init_group, leave_group
from engine.parallel.devices import rank_device, set_cpu_threads
from engine.parallel.rpc import RpcServer
from engine.parallel.shard import ModelShard

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)
RANK_DIED = 70  # exit status of an engine process whose rank died (EX_SOFTWARE)


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank process needs to build its shard of the engine."""

    config: EngineConfig
    max_len: int
    rank: int
    size: int
    store_host: str
    store_port: int


@dataclass
class RankContext:
    """What calls into a rank (``engine.parallel.rpc``) get: the rank's runner (its pool, block
    size, device) and a dict where callers keep their state between calls."""

    rank: int
    size: int
    runner: ModelRunner
    state: dict[str, Any] = field(default_factory=dict)


def rank_main(spec: RankSpec, commands: Connection, calls: Connection) -> None:
    quick_handoffs()
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s rank{spec.rank} %(levelname)s %(name)s: %(message)s",
    )
    _watch_parent(os.getppid())
    dump_stacks_every(os.environ.get(DUMP_STACKS_ENV, ""))
    device = rank_device(spec.config, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        set_cpu_threads(spec.size)
    server = RpcServer(calls, None)
    server.ready()
    init_group(client_store(spec.store_host, spec.store_port, spec.size), spec.rank, spec.size,
               device)  # fmt: skip
    from engine.model_runner import ModelRunner
    from engine.warmup import warm_up

    mc = ModelConfig.from_dir(spec.config.model_dir)
    comm = TPComm(ModelShard.of(mc, spec.size, spec.rank))
    runner = ModelRunner(spec.config, mc, spec.max_len, comm)
    warm_up(runner, spec.max_len)  # at the point of its build where rank 0 warms up too
    server.context = RankContext(spec.rank, spec.size, runner)
    server.start()
    while True:
        try:
            op, args = commands.recv()
        except (EOFError, OSError):  # rank 0 is gone
            os._exit(RANK_DIED)
        if op == "stop":
            break
        runner.follow(op, args)
    runner.release_graphs()  # NCCL's shutdown waits for graphs that hold its collectives
    leave_group()


# Diagnosis of a hang (a collective one rank never reaches): every N seconds each rank process
# writes every thread's Python stack to stderr, from C, so even a thread blocked inside NCCL or
# CUDA shows where it is. Off unless set (rank 0, the engine's own process, takes it in
# ``RankGroup.start``).
DUMP_STACKS_ENV = "TANDEM_DUMP_STACKS_S"


def dump_stacks_every(seconds: str) -> None:
    """``faulthandler``'s repeated dump of every thread's stack every ``seconds`` (the value of
    ``TANDEM_DUMP_STACKS_S``; empty or 0: off)."""
    try:
        every = float(seconds) if seconds else 0.0
    except ValueError:
        log.warning("%s=%r is not a number of seconds: no stack dumps", DUMP_STACKS_ENV, seconds)
        return
    if every > 0:
        faulthandler.dump_traceback_later(every, repeat=True)


def _watch_parent(parent: int) -> None:
    """Exit when rank 0's process is gone, even inside a collective that would never return."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(RANK_DIED)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
