"""The local stack: real etcd on loopback, then router, prefill and decode workers and the
gateway as child processes on 127.0.0.1 that die with the process that started them (see
``services.launcher.process``). Used by ``tandem serve``, ``tandem bench`` and the end-to-end
tests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from services.launcher import process
from services.launcher.adapters import assign_adapters
from services.launcher.etcd import EtcdServer, free_port
from services.launcher.kv_budget import fit_cpu_pools
from services.launcher.placement import Placement, cpu_share
from services.launcher.process import Child

# StackConfig lives in its own module (``kv_budget`` and ``options`` read it too); it is named
# here as well, where the stack's users import it from.
from services.launcher.stack_config import COLOCATED_THRESHOLD as COLOCATED_THRESHOLD
from services.launcher.stack_config import StackConfig
from services.launcher.supervisor import RestartPolicy, Supervisor


class Stack:
    """Starts and stops the whole local stack; each child logs to ``run_dir/logs/NAME.log``."""

    def __init__(self, config: StackConfig) -> None:
        # On the CPU: pools that hold the context, or the context capped to the pools.
        self.config, self.kv_note = fit_cpu_pools(config)
        try:  # before anything starts: an adapter that fits no model stops the launch
            self.adapters = assign_adapters(config.lora_modules, self.config.models)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from e
        self.run_dir = Path(config.run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer(self.run_dir / "etcd", tls=config.etcd_tls)
        self.children: dict[str, Child] = {}

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def _python(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    def _worker_args(self, role: str, index: int, placement: Placement) -> list[str]:
        c = self.config
        model = c.worker_models().get(f"{role}-{index}", Path(c.model_dir).name)
        named = [] if c.models[model] == c.model_dir else ["--served-model-name", model]
        return self._python(
            f"services.{role}",
            "--model-dir", c.models[model],
            *named,
            "--etcd", self.etcd.endpoint,
            "--worker-id", f"{role}-{index}",
            "--port", "0",
            *c.worker_option_args(),
            *placement.args,
            "--tensor-parallel-size", str(c.tp_of(role)),
            "--member-ttl", str(c.member_ttl),
            "--member-refresh", str(c.member_refresh),
            "--lease-seconds", str(c.lease_seconds),
            *(["--kv-transport", c.kv_transport] if c.kv_transport else []),
            *(["--switchable"] if c.switch_roles else []),
            *[f"--lora-modules={adapter}" for adapter in self.adapters[model]],
            *c.worker_args,
        )  # fmt: skip

    def _router_args(self, port: int, first: bool = True) -> list[str]:
        c = self.config
        return self._python(
            "services.router",
            "--model-dir", c.model_dir,
            "--etcd", self.etcd.endpoint,
            "--port", str(port),
            "--decode-only-threshold", str(c.decode_only_threshold),
            *(["--disagg-mode", c.disagg_mode] if c.disagg_mode else []),
            *(["--balance-roles"] if c.switch_roles and first else []),
            *[f"--extra-model={m}" for m in c.extra_models],
            *(["--policy", c.router_policy] if c.router_policy else []),
            *[f"--api-key={k}" for k in c.api_keys],
            *c.router_args,
        )  # fmt: skip

    def start(self) -> Stack:
        c = self.config
        self.etcd.start()
        keys = [f"--api-key={k}" for k in c.api_keys]
        routers = []
        for i in range(max(c.num_routers, 1)):
            port = free_port()
            routers.append(f"{c.host}:{port}")
            name = "router" if i == 0 else f"router-{i}"
            self._spawn(name, self._router_args(port, i == 0), routers[-1])
        self._spawn_workers(time.monotonic() + c.start_timeout)
        gateway = self._python(
            "services.gateway",
            "--model-dir", c.model_dir,
            "--host", c.host,
            "--port", str(c.port),
            *[f"--router={address}" for address in routers],
            *[f"--extra-model={m}" for m in c.extra_models],
            *(["--max-model-len", str(c.max_model_len)] if c.max_model_len else []),
            *keys,
            # The routers check the same keys: the gateway presents the first as its own.
            *([f"--router-api-key={c.api_keys[0].partition(':')[0]}"] if c.api_keys else []),
            *c.gateway_args,
        )  # fmt: skip
        self._spawn("gateway", gateway, f"{c.host}:{c.port}")
        self.wait_ready()
        return self

    def _spawn_workers(self, deadline: float) -> None:
        """Every worker on its device; workers sharing a device start one after another, each
        once the one before printed READY (each sizes its KV pool from the free memory)."""
        last_on: dict[str, Child] = {}
        for name, placement in self.config.placements().items():
            role, _, index = name.partition("-")
            for before in {id(c): c for d in placement.devices if (c := last_on.get(d))}.values():
                self.wait_logged(before, "READY", deadline)
            argv = self._worker_args(role, int(index), placement)
            child = self._spawn(name, argv, env=placement.env)
            last_on.update(dict.fromkeys(placement.devices, child))

    def _observability_args(self, name: str) -> tuple[list[str], int]:
        """Flags giving process ``name`` a free metrics port and (optionally) a trace file."""
        args: list[str] = []
        port = free_port(self.config.host) if self.config.metrics else 0
        if port:
            args += ["--metrics-host", self.config.host, "--metrics-port", str(port)]
        if self.config.trace_files:
            (self.run_dir / "traces").mkdir(exist_ok=True)
            args += ["--trace-file", str(self.run_dir / "traces" / f"{name}.jsonl")]
        return args, port

    def scrape_targets(self) -> dict[str, str]:
        """name -> host:port of every process's /metrics (what a local Prometheus scrapes)."""
        return {
            name: f"{self.config.host}:{child.metrics_port}"
            for name, child in self.children.items()
            if child.metrics_port
        }

    def write_prometheus_config(
        self, path: Path | None = None, namespace: str = "local", interval: str = "5s"
    ) -> Path:
        """A Prometheus config that scrapes every process of the stack, with the ``namespace``
        label the dashboards select on (JSON, which Prometheus reads as YAML)."""
        path = path or self.run_dir / "prometheus.yml"
        targets = sorted(self.scrape_targets().values())
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {
                    "job_name": "tandem",
                    "static_configs": [{"targets": targets, "labels": {"namespace": namespace}}],
                }
            ],
        }
        path.write_text(json.dumps(config, indent=2) + "\n")
        return path

    def _spawn(
        self, name: str, argv: list[str], address: str = "", env: dict[str, str] | None = None
    ) -> Child:
        extra, port = self._observability_args(name)
        log_path = self.run_dir / "logs" / f"{name}.log"
        child = Child(name, [*argv, *extra], log_path, dict(env or {}), address=address)
        if name.startswith(("prefill", "decode")):
            child.nice = self.config.worker_nice
        child.metrics_port = port
        child.log_path.write_bytes(b"")  # a reused run dir must not show an old READY line
        self._launch(child)
        self.children[name] = child
        return child

    def _launch(self, child: Child) -> None:
        process.launch(child)  # dies with this process (tests replace this to record starts)

    def wait_ready(self) -> None:
        """Every worker printed READY and the gateway is ready (/health 200: it can route to a
        live decode worker); a stack without decode workers only waits for the gateway to be
        live (/livez), since it cannot be ready until one is added (`add_worker`)."""
        deadline = time.monotonic() + self.config.start_timeout
        for child in self.children.values():
            if child.name != "gateway":
                self.wait_logged(child, "READY", deadline)
        self.wait_http_ok("/health" if self.config.num_decode else "/livez", deadline)

    def add_worker(self, role: str) -> Child:
        """Start one more ``role`` worker (CPU placement, its share of the cores as if the
        stack had started with it) and wait until it printed READY."""
        index = sum(1 for name in self.children if name.startswith(f"{role}-"))
        name = f"{role}-{index}"
        workers = sum(1 for n in self.children if n.startswith(("prefill-", "decode-")))
        placement = Placement(cpu_threads=cpu_share(workers + 1))
        child = self._spawn(name, self._worker_args(role, index, placement), env=placement.env)
        self.wait_logged(child, "READY", time.monotonic() + self.config.start_timeout)
        return child

    def wait_logged(self, child: Child, marker: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            text = child.log_path.read_text(errors="replace")
            if marker in text:
                if not child.address:
                    line = text[text.rindex(marker) :].splitlines()[0]
                    child.address = line.split()[-1]
                if marker == "READY":
                    process.serving(child)
                return
            if child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited:\n{text[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{child.name} did not start; see {child.log_path}")

    def wait_http_ok(self, path: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gateway {self.url}{path} not ready; see {self.run_dir}/logs")

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Send ``sig`` and wait up to ``timeout`` s for the exit (SIGTERM drains first)."""
        child = self.children[name]
        assert child.proc is not None
        child.proc.send_signal(sig)
        child.proc.wait(timeout)

    def restart(self, name: str) -> Child:
        """Start a (killed) child again with the same command line."""
        child = self.children[name]
        child.address = "" if name.startswith(("prefill", "decode")) else child.address
        with open(child.log_path, "ab") as f:
            f.write(b"\n--- restarted ---\n")
        size = child.log_path.stat().st_size
        self._launch(child)
        deadline = time.monotonic() + self.config.start_timeout
        while time.monotonic() < deadline:
            with open(child.log_path, "rb") as f:
                f.seek(size)
                tail = f.read().decode(errors="replace")
            if "READY" in tail or name == "gateway":
                break
            time.sleep(0.1)
        if "READY" in tail:
            child.address = tail[tail.index("READY") :].splitlines()[0].split()[-1]
            process.serving(child)
        return child

    def supervisor(self, policy: RestartPolicy | None = None, say=print) -> Supervisor:
        """A supervisor that restarts this stack's children (and etcd) when they exit."""
        return Supervisor(self.children, self._launch, self.etcd, policy, say)

    def drain_order(self) -> list[list[Child]]:
        """The order ``stop`` ends the children in, group after group: the gateway (it stops
        taking requests and lets open streams finish), then the workers (decode workers finish
        their streams; prefill workers' held KV can still be pulled meanwhile), then the
        routers; etcd last."""
        groups: list[list[Child]] = [[], [], []]
        for child in self.children.values():
            rank = 0 if child.name == "gateway" else 2 if child.name.startswith("router") else 1
            groups[rank].append(child)
        return [g for g in groups if g]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM each group of ``drain_order`` and wait up to ``grace`` s for it to exit
        (SIGKILL after that), then stop etcd."""
        for group in self.drain_order():
            live = [c for c in group if c.proc is not None and c.proc.poll() is None]
            for child in live:
                assert child.proc is not None
                child.proc.terminate()
            deadline = time.monotonic() + grace
            for child in group:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        self.etcd.close()

    def __enter__(self) -> Stack:
        try:
            return self.start()
        except BaseException:  # __exit__ is not called then: leave no process behind
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
