"""The router's part of the token path alone, at GPU message rates on a CPU machine: router CPU
per token and the router-path TTFT of a new request while ``--streams`` streams run.

Everything is real but the decode worker: a real etcd on loopback, a real router process
(``python -m services.router``, colocated: every request decode-only), and a client that is the
gateway's own backend (`services.gateway.grpc_backend`). The decode worker is an in-process
stand-in (``bench.relay_worker``) registered in etcd like a real one, streaming one token per
stream per ``--step-ms`` tick of a shared step clock, as an engine step emits every stream's
token at once. With ``--token-path relay`` events go stand-in -> router -> client (the router's
Generate), one TokenEvent per stream per step; with ``direct`` (the gateway's default) the
router's Route names the stand-in and the client streams from it itself.

With ``--gateway`` a real gateway process (``python -m services.gateway``, as a stack starts it)
stands in front of the router and the client is ``tandem bench``'s SSE client sending OpenAI
streaming chat requests to it over HTTP (`bench.relay_http`); the stand-in's tokens are then
real tokens of the model with their text, every stream's text is checked, and the report adds
the gateway's cores and CPU µs per token (its ``path`` is the gateway's and the router's).
``--tokens-per-step K`` has the stand-in send a stream's K tokens of a step in one event.

    python -m bench.router_relay --streams 64 --step-ms 10 --tokens 300 --out FILE.json
    python -m bench.router_relay --gateway --streams 64 --step-ms 10 --tokens 300 --out FILE.json

Router (and gateway) CPU is read (psutil, the process and its children) over the loaded window,
less its idle rate measured before any traffic. Probes (one 1-token request every ``--probe-every``
s) give the TTFT through the router idle and under load; ``path`` is that TTFT less the
stand-in's wait for its next tick. ``--router-checkout DIR`` runs the router from another
tree (before/after a change to the relay) with this harness."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench.relay_client import Client, Probe, Streams, Tally
from bench.relay_http import HttpClient, token_script
from bench.relay_report import git_commit, report, table
from bench.relay_worker import StandIn
from services.gateway.grpc_backend import GrpcBackend
from services.launcher.etcd import EtcdServer, free_port
from services.launcher.process import die_with_parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.router_relay", description=__doc__)
    p.add_argument("--streams", type=int, default=64, help="concurrent streams kept running")
    p.add_argument("--step-ms", type=float, default=10.0, help="the stand-in's step (ms)")
    p.add_argument("--tokens", type=int, default=300, help="tokens per stream")
    p.add_argument(
        "--tokens-per-step", type=int, default=1, help="tokens in each step's event of a stream"
    )
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the loaded window")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the window")
    p.add_argument("--idle-seconds", type=float, default=3.0, help="router idle CPU window")
    p.add_argument("--idle-probes", type=int, default=20, help="probes before any load")
    p.add_argument("--probe-every", type=float, default=0.5, help="seconds between probes")
    p.add_argument("--model-dir", default="", help="router's model folder (default: SmolLM2)")
    p.add_argument("--router-checkout", default="", help="run the router from this tree")
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag")
    p.add_argument(
        "--token-path",
        choices=("direct", "relay"),
        default="direct",
        help="the gateway's: stream from the worker (direct) or through the router",
    )
    p.add_argument(
        "--gateway",
        action="store_true",
        help="also run a real gateway process; stream OpenAI chat requests through it over HTTP",
    )
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag")
    p.add_argument("--out", default="", help="write the JSON report here")
    args = p.parse_args(argv)
    if min(args.streams, args.tokens, args.tokens_per_step, args.step_ms, args.seconds) <= 0:
        p.error("--streams, --tokens, --tokens-per-step, --step-ms and --seconds must be positive")
    return args


def model_dir(args: argparse.Namespace) -> str:
    if args.model_dir:
        return args.model_dir
    from engine.bundled import DEFAULT_DIR, convert

    return str(convert(DEFAULT_DIR))


def start_router(args, etcd: str, model: str, log: Path) -> tuple[subprocess.Popen, str]:
    """The router as a stack starts it (`services.launcher.stack`), logging to ``log``."""
    port = free_port()
    argv = [
        "services.router", "--model-dir", model, "--etcd", etcd, "--port", str(port),
        "--decode-only-threshold", str(1 << 30), *args.router_arg,
    ]  # fmt: skip
    return _spawn(argv, args.router_checkout or os.getcwd(), log), f"127.0.0.1:{port}"


def start_gateway(args, router: str, model: str, log: Path) -> tuple[subprocess.Popen, str]:
    """The gateway as a stack starts it (`services.launcher.stack`), in front of ``router``;
    its base URL (``.../v1``)."""
    port = free_port()
    argv = [
        "services.gateway", "--model-dir", model, "--host", "127.0.0.1", "--port", str(port),
        f"--router={router}", f"--token-path={args.token_path}", *args.gateway_arg,
    ]  # fmt: skip
    return _spawn(argv, os.getcwd(), log), f"http://127.0.0.1:{port}/v1"


def _spawn(argv: list[str], cwd: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            die_with_parent([sys.executable, "-m", *argv]), cwd=cwd, stdout=out,
            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )  # fmt: skip


async def wait_ready(procs: dict[str, subprocess.Popen], log: Path, client: Streams,
                     timeout: float) -> None:  # fmt: skip
    """Until the router printed READY and a stream runs to its end (through the gateway too)."""
    deadline = time.monotonic() + timeout
    while b"READY router" not in log.read_bytes():
        if procs["router"].poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"router not ready; log {log}:\n{log.read_text()[-3000:]}")
        await asyncio.sleep(0.1)
    last: Exception | str | None = None
    while time.monotonic() < deadline and all(p.poll() is None for p in procs.values()):
        try:
            await client.one_stream()
            if client.tally.streams_done:
                client.tally = Tally()  # the measured run starts from nothing
                return
            last = (client.tally.stream_errors or client.tally.order_errors or [None])[-1]
        except Exception as e:  # noqa: BLE001 - retried until the deadline, then reported
            last = e
        client.tally = Tally()
        await asyncio.sleep(0.2)
    raise RuntimeError(f"no stream reaches the stand-in: {last}; logs in {log.parent}")


def cpu_seconds(proc: psutil.Process, children: bool = True) -> float:
    """User + system CPU seconds of ``proc`` and (``children``) its live children."""
    total = 0.0
    for p in [proc, *(proc.children(recursive=True) if children else ())]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


async def measure(args, etcd: str, model: str, run_dir: Path) -> dict:
    """Start the stand-in, the router (and the gateway), measure idle, then under load; the raw
    figures (CPU seconds of each measured process: ``cpu_s``, its idle rate: ``idle_cores``)."""
    name = Path(model).name
    script = token_script(model) if args.gateway else ()
    stand_in = await StandIn.start(
        etcd, name, args.step_ms / 1000, script=script, per_step=args.tokens_per_step
    )
    log = run_dir / "router.log"
    router, address = start_router(args, etcd, model, log)
    procs = {"router": router}
    backend = GrpcBackend([address], model=name, direct=args.token_path == "direct")
    client: Client | HttpClient = Client(backend, name, args.tokens, args.prompt_tokens)
    if args.gateway:
        procs["gateway"], url = start_gateway(args, address, model, run_dir / "gateway.log")
        client = HttpClient(url, name, args.tokens, args.prompt_tokens, list(script))
    tasks: list[asyncio.Task] = []
    try:
        await wait_ready(procs, log, client, timeout=90)
        measured = {k: psutil.Process(p.pid) for k, p in procs.items()}
        me = psutil.Process()
        c0, t0 = {k: cpu_seconds(p) for k, p in measured.items()}, time.monotonic()
        await asyncio.sleep(args.idle_seconds)
        idle_s = time.monotonic() - t0
        idle_cores = {k: (cpu_seconds(p) - c0[k]) / idle_s for k, p in measured.items()}
        step = args.step_ms / 1000
        idle = [await _spaced_probe(client, stand_in, step) for _ in range(args.idle_probes)]
        start = time.monotonic()
        end = start + args.warmup + args.seconds
        tasks = [
            asyncio.create_task(client.keep_running(k, args.streams, step, end + 60))
            for k in range(args.streams)
        ]
        await asyncio.sleep(args.warmup)
        late_from = len(stand_in.clock.late_s)
        c0, h0, t0 = {k: cpu_seconds(p) for k, p in measured.items()}, cpu_seconds(me, False), \
            time.monotonic()  # fmt: skip
        client.tally.counting = True
        loaded = await client.probes(stand_in.servicer.state, args.probe_every, end, step)
        client.tally.counting = False
        c1 = {k: cpu_seconds(p) for k, p in measured.items()}
        h1, t1 = cpu_seconds(me, False), time.monotonic()
        return {
            "window_s": t1 - t0, "idle_cores": idle_cores,
            "cpu_s": {k: c1[k] - c0[k] for k in c1}, "harness_cpu_s": h1 - h0,
            "idle_probes": idle, "loaded_probes": loaded,
            "late_s": stand_in.clock.late_s[late_from:], "tally": client.tally,
            "stand_in": stand_in.servicer.state,
            "alive": {k: p.poll() is None for k, p in procs.items()},
        }  # fmt: skip
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for proc in reversed(procs.values()):  # the gateway first
            await _stop(proc)
        if isinstance(client, HttpClient):
            await client.close()
        await backend.close()
        await stand_in.stop()


async def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        await asyncio.to_thread(proc.wait, 10)
    if proc.poll() is None:
        proc.kill()


async def _spaced_probe(client: Streams, stand_in: StandIn, step_s: float) -> Probe:
    await asyncio.sleep(0.1 + random.uniform(0, step_s))  # every phase of the step clock
    return await client.probe(stand_in.servicer.state)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    model = model_dir(args)
    with EtcdServer() as etcd:
        raw = asyncio.run(measure(args, etcd.endpoint, model, etcd.run_dir))
    out = report(args, raw, load_before, os.getloadavg())
    out["command"] = "python -m bench.router_relay " + " ".join(argv or sys.argv[1:])
    out["commit"] = git_commit(os.getcwd())
    if args.router_checkout:
        out["router_checkout"] = args.router_checkout
        out["router_commit"] = git_commit(args.router_checkout)
    print(table(out))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
