"""The supervisor that heals (``tandem serve``): a child that exits is started again with
backoff while the rest serves, a child that keeps crashing is given up on (and said so), and
Ctrl-C/SIGTERM stops everything in drain order. The end-to-end test kills a decode worker, the
router and etcd of a real ``tandem serve`` with ``kill -9`` and serves fresh requests after
each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from services.launcher.etcd import free_port
from services.launcher.process import Child, launch
from services.launcher.stack import Stack, StackConfig
from services.launcher.supervisor import RestartPolicy, Supervisor
from tests.stack.test_no_orphans import alive, children_of


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff=0.5, max_backoff=3.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        RestartPolicy(max_crashes=0)


def crasher(tmp_path: Path, name: str, code: int = 3) -> Child:
    argv = [sys.executable, "-c", f"import sys; print('alive'); sys.exit({code})"]
    child = Child(name, argv, tmp_path / f"{name}.log")
    launch(child)
    return child


@pytest.mark.timeout(60)
def test_a_child_that_keeps_crashing_is_restarted_then_given_up_on(tmp_path) -> None:
    said: list[str] = []
    child = crasher(tmp_path, "decode-0")
    stable = Child("router", [sys.executable, "-c", "import time; time.sleep(60)"],
                   tmp_path / "router.log")  # fmt: skip
    launch(stable)
    policy = RestartPolicy(backoff=0.05, max_backoff=0.2, max_crashes=3, window=30)
    sup = Supervisor({"decode-0": child, "router": stable}, launch, policy=policy, say=said.append)
    deadline = time.monotonic() + 30
    try:
        while not sup.given_up and time.monotonic() < deadline:
            sup.poll()
            time.sleep(0.02)
        assert sup.given_up == ["decode-0"]
        assert sup.restarts == 2  # started 3 times in all, crashed 3 times
        assert child.log_path.read_text().count("alive") == 3
        assert sum("exited unexpectedly (exit code 3); restarting" in s for s in said) == 2
        assert "GIVING UP on decode-0: it exited 3 times within 30 s" in said[-1]
        assert stable.proc is not None and stable.proc.poll() is None  # untouched
        for _ in range(5):  # given up: never started again
            sup.poll()
        assert sup.restarts == 2
    finally:
        assert stable.proc is not None
        stable.proc.kill()
        stable.proc.wait()


def test_crashes_outside_the_window_do_not_add_up(tmp_path) -> None:
    now = [0.0]
    said: list[str] = []
    child = crasher(tmp_path, "prefill-0")
    policy = RestartPolicy(backoff=1.0, max_backoff=8.0, max_crashes=2, window=10)
    sup = Supervisor({"prefill-0": child}, launch, policy=policy, say=said.append,
                     clock=lambda: now[0])  # fmt: skip
    for step in range(4):  # a crash every 20 s: each the first in its window
        assert child.proc is not None
        child.proc.wait(10)
        sup.poll()
        assert "restarting it in 1.0 s" in said[-1], said
        now[0] += 1.0
        sup.poll()
        assert sup.restarts == step + 1
        now[0] += 19.0
    assert sup.given_up == []
    assert child.proc is not None
    child.proc.wait(10)


def test_stop_goes_in_drain_order(tmp_path) -> None:
    stack = Stack(StackConfig(model_dir="m", run_dir=str(tmp_path)))
    for name in ("router", "router-1", "prefill-0", "decode-0", "gateway"):
        stack.children[name] = Child(name, [], tmp_path / name)
    order = [[c.name for c in group] for group in stack.drain_order()]
    assert order == [["gateway"], ["prefill-0", "decode-0"], ["router", "router-1"]]


# -- a real `tandem serve` ---------------------------------------------------------------------


def find_child(serve_pid: int, marker: str) -> int:
    [pid] = [pid for pid, cmd in children_of(serve_pid).items() if marker in cmd]
    return pid


def wait_line(lines: list[str], text: str, after: int, timeout: float) -> int:
    """Index of the first line after ``after`` containing ``text``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i in range(after, len(lines)):
            if text in lines[i]:
                return i
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in {timeout:.0f} s:\n" + "".join(lines[after:]))


def served_within(client: openai.OpenAI, model: str, seconds: float) -> float:
    """Seconds until a fresh greedy request succeeds (retrying errors), at most ``seconds``."""
    t0 = time.monotonic()
    last: Exception | None = None
    while time.monotonic() - t0 < seconds:
        try:
            out = client.completions.create(
                model=model, prompt="The capital of France is", max_tokens=4, temperature=0
            )
            if out.choices[0].finish_reason in ("stop", "length"):
                return time.monotonic() - t0
        except openai.APIStatusError as e:
            if e.status_code < 500 and e.status_code != 429:
                raise
            last = e
        except openai.APIConnectionError as e:
            last = e
        time.sleep(0.3)
    raise AssertionError(f"no request served within {seconds} s: {last}")


@pytest.mark.stack  # `make test-stack`
@pytest.mark.timeout(420)
def test_serve_heals_a_killed_decode_worker_router_and_etcd(smol_dir, tmp_path) -> None:
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--model", str(smol_dir), "--port", str(port),
         "--run-dir", str(tmp_path), "--prefill-workers", "1", "--decode-workers", "2",
         "--kv-cache-mib", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    assert serve.stdout is not None
    threading.Thread(target=lambda: lines.extend(serve.stdout), daemon=True).start()
    kids: dict[int, str] = {}
    try:
        at = wait_line(lines, "Ctrl-C stops everything", 0, 240)
        kids = children_of(serve.pid)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        for marker, name, ready in (
            ("--worker-id decode-1", "decode-1", "decode-1 is serving again"),
            ("services.router", "router", "router is serving again"),
            ("--data-dir", "etcd", "etcd restarted"),
        ):
            victim = find_child(serve.pid, marker)
            os.kill(victim, signal.SIGKILL)
            at = wait_line(lines, f"{name} exited unexpectedly", at, 10)
            at = wait_line(lines, ready, at, 90)
            assert alive(find_child(serve.pid, marker))  # a new process in its place
            assert served_within(client, Path(smol_dir).name, 15) < 15
            kids.update(children_of(serve.pid))
        assert serve.poll() is None  # the stack never went down
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
        assert "stopping..." in "".join(lines[at:])
        assert not [pid for pid in kids if alive(pid)]  # every child ended, restarts included
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice():
    """A port handed to a child is picked where no outgoing connection can take it before the
    child binds it, and one process never hands the same port out twice."""
    from services.launcher.etcd import _ephemeral_low

    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low > 11000:
        assert all(10000 <= p < low for p in ports), ports


def test_workers_run_below_the_other_processes_cpu_priority_once_they_serve(tmp_path) -> None:
    """`tandem serve` lowers its workers' CPU priority (``worker_nice``) once they print READY
    (loading the model is not slowed), so the gateway and router get a core at once while the
    workers' compute fills them (issue 18's fast 429s): every thread's nice value and (with
    autogroups) the session's autogroup's, since each child leads a session of its own."""
    code = (
        "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
        "print('READY x 1', flush=True); time.sleep(30)"
    )
    child = Child("decode-0", [sys.executable, "-c", code], tmp_path / "decode-0.log", nice=7)
    stack = Stack(StackConfig("/m", str(tmp_path / "run")))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    launch(child)
    try:
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == base  # starts at full priority
        stack.wait_logged(child, "READY", time.monotonic() + 30)
        tasks = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tasks) == 2
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tasks} == {base + 7}
        autogroup = Path(f"/proc/{child.pid}/autogroup")
        if autogroup.exists() and Path("/proc/sys/kernel/sched_autogroup_enabled").exists():
            assert autogroup.read_text().split()[-1] == "7"
    finally:
        child.proc.kill()
        child.proc.wait()
    assert stack.config.worker_nice == 10
    stack._launch = lambda c: None  # type: ignore[method-assign]
    for name in ("router", "gateway", "prefill-0", "decode-0"):
        stack._spawn(name, ["true"])
    assert {n: c.nice for n, c in stack.children.items()} == {
        "router": 0, "gateway": 0, "prefill-0": 10, "decode-0": 10}  # fmt: skip
