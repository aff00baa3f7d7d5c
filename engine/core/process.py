"""The engine core in its own process: a worker's model steps never share a GIL with its gRPC
server, etcd keepalives or KV transfers.

The worker spawns one child (``start``); the child builds the ``LLMEngine`` (and through it any
tensor-parallel ranks, which are its own children), makes its KV pool mappable from the worker
(a memfd on the host, a CUDA IPC export on a GPU), sends `Ready`, then runs `EngineLoop` on its
main thread while a reader thread queues the worker's commands. Messages are pickled over one
duplex pipe: commands in, one `StepMessage` per step out (plus replies).

Failure: the child exits when the worker is gone (the pipe ends, or its parent pid changes). The
worker learns of the child's death from the pipe's end (`ProcessChannel`); a worker whose engine
died cannot serve, so it ends with ``ENGINE_DIED``, as a tensor-parallel rank's death ends it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from engine.config import EngineConfig
from engine.core.messages import EngineInfo, PoolShare, Ready, StartFailed, Stop
from engine.gil import quick_handoffs

log = logging.getLogger(__name__)
ENGINE_DIED = 70  # a worker's exit status when its engine process died (as RANK_DIED)
START_TIMEOUT_S = 900.0  # build, load weights, capture graphs and warm up


class EngineDied(RuntimeError):
    """The engine process is gone."""


class ProcessChannel:
    """The worker's end of the engine process: `send` queues a command (a writer thread
    pickles it, so the event loop never blocks on a full pipe); `start` hands every message to
    ``dispatch`` on the event loop, which reads the pipe itself when it is readable (no thread
    of this process competes with the loop for the GIL to take a step's message), ending with
    an `EngineDied`."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.proc = proc
        self.conn = conn
        self.closing = False
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="engine-writer", daemon=True)

    @property
    def alive(self) -> bool:
        return self.proc.is_alive() and not self.closing

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> EngineInfo:
        """Block until the engine is built; raises EngineDied with its reason otherwise."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise EngineDied(f"the engine process exited with {self.proc.exitcode} at start")
            if time.monotonic() > deadline:
                self.kill()
                raise EngineDied(f"the engine did not start within {timeout:.0f} s")
        msg = self.conn.recv()
        if isinstance(msg, StartFailed):
            self.proc.join(10)
            raise EngineDied(msg.message)
        assert isinstance(msg, Ready), msg
        return msg.info

    def start(self, loop: asyncio.AbstractEventLoop, dispatch: Callable[[object], None]) -> None:
        self._writer.start()
        loop.add_reader(self.conn.fileno(), self._readable, loop, dispatch)

    def send(self, msg: object) -> None:
        self._out.put(msg)

    def _write(self) -> None:
        while True:
            msg = self._out.get()
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return  # the reader reports the death
            if isinstance(msg, Stop):
                return

    def _readable(
        self, loop: asyncio.AbstractEventLoop, dispatch: Callable[[object], None]
    ) -> None:
        """Every whole message waiting (the engine writes each in one go)."""
        try:
            while self.conn.poll():
                dispatch(self.conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(self.conn.fileno())
            self.proc.join(1.0)
            dispatch(EngineDied(f"the engine process exited with {self.proc.exitcode}"))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop, wait for the process, kill it past ``timeout``."""
        if self.closing:
            return
        self.closing = True
        self.send(Stop())
        self.proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


def start(config: EngineConfig, log_level: str = "info", name: str = "engine") -> ProcessChannel:
    """Spawn the engine process (not a daemon: it starts tensor-parallel ranks of its own)."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(
        target=main, args=(config, there, os.getpid(), log_level, name), name=f"tandem-{name}"
    )
    proc.start()
    there.close()
    return ProcessChannel(proc, here)


# -- inside the engine process ----------------------------------------------------------------
def main(config: EngineConfig, conn: Connection, parent: int, log_level: str, name: str) -> None:
    quick_handoffs()
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    _watch_parent(parent)
    from engine.errors import (
        InsufficientMemoryError,
        UnsupportedConfigError,
        UnsupportedModelError,
    )

    known = (InsufficientMemoryError, UnsupportedModelError, UnsupportedConfigError, ValueError)
    try:
        engine, info = _build(config)
    except known as e:
        conn.send(StartFailed(str(e)))
        return
    except BaseException as e:
        log.exception("the engine failed to start")
        conn.send(StartFailed(f"the engine failed to start: {e!r}"))
        return
    conn.send(Ready(info))
    _serve(engine, conn)


def _build(config: EngineConfig) -> tuple[Any, EngineInfo]:
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    return engine, engine_info(engine, share=True)


def engine_info(engine: Any, share: bool) -> EngineInfo:
    """The facts a client needs about ``engine`` (an ``LLMEngine``); with ``share``, how
    another process maps its pool."""
    runner, config = engine.runner, engine.config
    return EngineInfo(
        layout=runner.layout,
        block_size=config.block_size,
        num_blocks=engine.pool.num_blocks,
        block_bytes=runner.block_bytes,
        dtype=str(runner.dtype).removeprefix("torch."),
        device=str(runner.device),
        checksum_algorithm=runner.checksum_algorithm,
        max_model_len=engine.max_model_len,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_lora=config.enable_lora,
        pool=pool_share(runner.kv_pool, runner.block_bytes) if share else None,
        pid=os.getpid(),
        host_blocks=engine.kv.tier.num_slots if engine.kv.tier is not None else 0,
    )


def pool_share(pool: Any, block_bytes: int) -> PoolShare | None:
    """How another process of this host maps ``pool`` (None: it cannot)."""
    from engine import kv_pool

    dtype = str(pool.dtype).removeprefix("torch.")
    nbytes = pool.numel() * pool.element_size()
    shape = tuple(pool.shape)
    if pool.device.type == "cuda":
        from libkv.transfer.cuda_ipc import export_pool

        ipc = export_pool(pool, block_bytes).to_json()
        return PoolShare(os.getpid(), shape, dtype, nbytes, ipc=ipc)
    fd = kv_pool.memfd_of(pool)
    return None if fd is None else PoolShare(os.getpid(), shape, dtype, nbytes, fd=fd)


def _serve(engine: Any, conn: Connection) -> None:
    """The loop on this thread; a writer thread puts its pickled messages on the pipe, so a
    step never waits for the worker to read the last one."""
    from engine.core.loop import EngineLoop

    out: queue.SimpleQueue = queue.SimpleQueue()

    def send(msg: object) -> None:  # any thread: a rank's reply comes from its reader
        out.put(ForkingPickler.dumps(msg))

    def write() -> None:
        while True:
            try:
                conn.send_bytes(out.get())
            except (OSError, ValueError):  # the worker is gone
                os._exit(ENGINE_DIED)

    threading.Thread(target=write, name="engine-messages", daemon=True).start()
    loop = EngineLoop(engine, send)

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the worker is gone
                os._exit(ENGINE_DIED)
            loop.submit(msg)
            if isinstance(msg, Stop):
                return

    threading.Thread(target=read, name="engine-commands", daemon=True).start()
    try:
        loop.run()
    finally:
        engine.close()


def _watch_parent(parent: int) -> None:
    """Exit when the worker's process is gone, even mid-step."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(ENGINE_DIED)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
