"""The other ranks of a tensor-parallel engine: one child process per rank, driven by rank 0.

Rank 0 is the engine's own process (scheduler, sampler, and the service around it); ranks
1..N-1 are started here with multiprocessing's spawn, each on its own device, and each holds
its shard of the weights and of the KV pool (``engine.parallel.worker``).

Commands: what rank 0 decides for a step (a batch to run, blocks to copy, read or write) goes
to every rank over its own pipe before rank 0 runs its part, and the ranks then meet in the
same collectives. A pipe rather than a broadcast over the process group: an idle worker waits
for its next step for as long as it likes (a collective would time out), and the end of the
pipe tells a rank at once that rank 0 is gone.

Calls (``call``): a second pipe per rank runs functions in the rank's process off its step
loop, on an asyncio loop of their own (the KV hand-off of each rank's shard runs there, while
steps go on); ``engine.parallel.rpc``.

Failure: a watchdog thread in rank 0 waits on every rank process. When one exits while the
engine runs, it kills the others and ends rank 0's process (status ``RANK_DIED``): a
collective with a dead rank never returns, so no step could finish, and a worker whose process
is gone lets its member lease lapse, so routers forget it. Ranks watch rank 0 in turn (the end
of the command pipe, or a new parent pid).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from engine.config import EngineConfig, ModelConfig
from engine.parallel.comm import TPComm, init_group, leave_group, master_store
from engine.parallel.devices import rank_device, set_cpu_threads
from engine.parallel.rpc import RpcClient
from engine.parallel.shard import ModelShard, check_tp, uneven
from engine.parallel.worker import (
    DUMP_STACKS_ENV,
    RANK_DIED,
    RankSpec,
    dump_stacks_every,
    rank_main,
)

log = logging.getLogger(__name__)
START_TIMEOUT = 300.0  # seconds for a rank to come up (spawn and import torch)


class RankGroup:
    """Ranks 1..N-1 of one engine, seen from rank 0."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._commands: list[Connection] = []
        self.rpc: dict[int, RpcClient] = {}
        self._closing = False
        self._dying = threading.Lock()
        self.store: Any = None
        self.comm: TPComm | None = None  # rank 0's place in the group, once joined

    @classmethod
    def start(cls, config: EngineConfig, max_len: int) -> RankGroup:
        """Spawn the ranks and wait until each is up (raises if one dies first); the caller
        then joins the process group as rank 0 (``store``)."""
        size = config.tensor_parallel_size
        group = cls(size)
        dump_stacks_every(os.environ.get(DUMP_STACKS_ENV, ""))  # this process is rank 0
        group.store = master_store(size)
        ctx = multiprocessing.get_context("spawn")

        ready: list[Connection] = []
        for rank in range(1, size):
            spec = RankSpec(config, max_len, rank, size, "127.0.0.1", group.store.port)
            cmd_read, cmd_write = ctx.Pipe(duplex=False)
            rpc_here, rpc_there = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                args=(spec, cmd_read, rpc_there),
                name=f"tandem-rank{rank}",
                daemon=True,
            )
            proc.start()
            cmd_read.close()
            rpc_there.close()
            group.procs.append(proc)
            group._commands.append(cmd_write)
            group.rpc[rank] = RpcClient(rank, rpc_here)
            ready.append(rpc_here)
        group._wait_up()
        atexit.register(group.close)  # before multiprocessing ends the ranks at exit
        threading.Thread(target=group._watch, name="rank-watchdog", daemon=True).start()
        for client in group.rpc.values():
            client.start()
        log.info(
            "tensor parallel: %d ranks (pids %s)", size, ", ".join(str(p.pid) for p in group.procs)
        )
        return group

    def _wait_up(self) -> None:
        """Each rank says it is up on its call pipe before anyone joins the process group."""
        deadline = time.monotonic() + START_TIMEOUT
        pending = {client.conn: rank for rank, client in self.rpc.items()}
        sentinels = {p.sentinel: i + 1 for i, p in enumerate(self.procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                late = sorted(pending.values())
                raise RuntimeError(f"tensor-parallel ranks {late} did not start")
            for obj in wait([*pending, *sentinels], timeout=left):
                if obj in sentinels:
                    self.kill()
                    raise RuntimeError(f"tensor-parallel rank {sentinels[obj]} exited at start")
                assert isinstance(obj, Connection)
                obj.recv()
                pending.pop(obj)

    def pids(self) -> list[int]:
        return [p.pid or 0 for p in self.procs]

    def send(self, op: str, args: tuple) -> None:
        """Queue ``op(*args)`` on every rank (in order with every other command)."""
        raw = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._commands:
            conn.send_bytes(raw)

    def call(self, rank: int, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(context, *args)`` in rank ``rank``'s process (``engine.parallel.rpc``)."""
        return self.rpc[rank].call(fn, *args)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        while sentinels:
            for s in wait(list(sentinels)):
                proc = sentinels.pop(s)  # type: ignore[arg-type]
                if not self._closing:
                    self._died(proc)

    def _died(self, proc: multiprocessing.process.BaseProcess) -> None:
        with self._dying:  # the watchdog and a failed step may both get here: one reports
            proc.join(1.0)  # reaped, so that its exit status is known
            log.critical(
                "tensor-parallel rank %s (pid %s) exited with %s: stopping the engine's "
                "other ranks and this process (a collective with it would never return)",
                proc.name, proc.pid, proc.exitcode,
            )  # fmt: skip
            self.kill()
            logging.shutdown()
            os._exit(RANK_DIED)

    def step_failed(self, wait_s: float = 2.0) -> None:
        """Called by rank 0 when its part of a step raised. A collective whose peer died can
        raise before the watchdog sees the death (gloo: connection reset): if a rank is gone,
        or goes within ``wait_s``, end the process as the watchdog would (``RANK_DIED``) rather
        than let the step's error pass for an ordinary one. Returns when every rank lives."""
        if self._closing:
            return
        deadline = time.monotonic() + wait_s
        while True:
            for p in self.procs:
                if not p.is_alive():
                    self._died(p)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank (they leave the process group) and wait for them."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        for conn in self._commands:
            try:
                conn.send_bytes(pickle.dumps(("stop", ())))
                conn.close()
            except OSError:
                pass
        for client in self.rpc.values():
            client.close()
        # Left while the ranks leave it too (they do on "stop"): NCCL's shutdown may wait for
        # its peers, so not only once they have exited; bounded, so closing never hangs.
        leave_group()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()


def start_ranks(config: EngineConfig, model_config: ModelConfig, max_len: int) -> RankGroup:
    """Check the TP size against the model, spawn ranks 1..N-1 and join their process group as
    rank 0 (this process); returns the group (``comm`` is rank 0's place in it)."""
    size = config.tensor_parallel_size
    check_tp(model_config, size)
    why = uneven(model_config, size)
    if why:
        log.warning("tensor parallel: %s; a step waits for the largest shard", why)
    device = rank_device(config, 0)
    if device.type == "cuda":
        last, count = rank_device(config, size - 1), torch.cuda.device_count()
        if last.index is not None and last.index >= count:
            raise ValueError(
                f"tensor_parallel_size {size} puts its ranks on {device}..{last} (one device "
                f"each), but this process sees {count} CUDA device(s)"
            )
        torch.cuda.set_device(device)
    else:
        set_cpu_threads(size)
    group = RankGroup.start(config, max_len)
    init_group(group.store, 0, size, device)
    group.comm = TPComm(ModelShard.of(model_config, size, 0))
    return group
