"""The supervisor of the local stack (``tandem serve``): a child that exits while the stack is
serving is started again, with the same command line, after an exponential backoff, while the
others keep serving. A restarted worker comes back with a new incarnation (a fresh id it draws
at start), so peers never use its old KV agent; the router, the gateway and etcd come back on
their old ports (etcd on its old data dir, so keys and revisions survive). A child that crashes
``max_crashes`` times within ``window`` seconds is given up on, and the supervisor says so.

It polls: `Supervisor.poll` notices exits and starts what is due; it never blocks on a child
coming up (a restarted worker prints READY when it is, and the supervisor reports it then).
Restarted children die with the thread that calls `poll` (see ``launcher.process``): call it
from the thread that owns the stack.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.launcher.etcd import EtcdServer, EtcdStartError
from services.launcher.process import Child, serving

ETCD = "etcd"


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When to start a child again: after ``backoff`` s, doubling with each crash within the
    window up to ``max_backoff``; never again once it crashed ``max_crashes`` times within
    ``window`` s."""

    backoff: float = 0.5
    max_backoff: float = 10.0
    max_crashes: int = 5
    window: float = 60.0

    def __post_init__(self) -> None:
        if self.backoff <= 0 or self.max_backoff < self.backoff:
            raise ValueError("0 < backoff <= max_backoff")
        if self.max_crashes < 1 or self.window <= 0:
            raise ValueError("max_crashes >= 1 and window > 0")

    def delay(self, recent_crashes: int) -> float:
        """Seconds to wait before the next start, after ``recent_crashes`` (>= 1) crashes."""
        return min(self.backoff * 2 ** (recent_crashes - 1), self.max_backoff)


@dataclass(slots=True)
class _Watch:
    """What the supervisor knows of one child."""

    crashes: deque[float] = field(default_factory=deque)  # times of recent crashes
    due: float | None = None  # when to start it again (None: running, or given up)
    given_up: bool = False
    starts: int = 1  # the incarnation the supervisor counts: 1 for the first start
    ready_from: int = -1  # log offset after which a READY line means the restart is up


class Supervisor:
    """Keeps ``children`` (and ``etcd``) running: see the module docstring. ``relaunch`` starts
    a child again with its command line (``launcher.process.launch``); ``say`` reports each
    exit, restart and give-up (``print`` by default)."""

    def __init__(
        self,
        children: Mapping[str, Child],
        relaunch: Callable[[Child], None],
        etcd: EtcdServer | None = None,
        policy: RestartPolicy | None = None,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.children = children
        self.relaunch = relaunch
        self.etcd = etcd
        self.policy = policy or RestartPolicy()
        self.say = say
        self.clock = clock
        self.watch: dict[str, _Watch] = {}
        self.restarts = 0  # starts after a crash, all children together

    def _state(self, name: str) -> _Watch:
        return self.watch.setdefault(name, _Watch())

    @property
    def given_up(self) -> list[str]:
        """Children the supervisor no longer restarts."""
        return [name for name, w in self.watch.items() if w.given_up]

    def poll(self) -> None:
        """Notice children that exited and start those whose backoff is over."""
        now = self.clock()
        for name, child in self.children.items():
            code = child.proc.poll() if child.proc is not None else None
            if child.proc is not None and code is not None:
                self._exited(name, f"exit code {code}", now, child.log_path)
            self._maybe_start(name, now, child)
            self._check_ready(name, child)
        if self.etcd is not None:
            if not self.etcd.is_running() and self.etcd.pid is not None:
                self.etcd.kill()  # reap it; pid is None from now on
                self._exited(ETCD, "exited", now, self.etcd.log_path)
            self._maybe_start(ETCD, now, None)

    def _exited(self, name: str, how: str, now: float, log_path: object) -> None:
        w = self._state(name)
        if w.due is not None or w.given_up:
            return  # already handled
        w.crashes.append(now)
        while w.crashes and w.crashes[0] < now - self.policy.window:
            w.crashes.popleft()
        n = len(w.crashes)
        if n >= self.policy.max_crashes:
            w.given_up = True
            self.say(
                f"GIVING UP on {name}: it exited {n} times within {self.policy.window:.0f} s "
                f"(last: {how}); the rest of the stack keeps serving without it; see {log_path}"
            )
            return
        w.due = now + self.policy.delay(n)
        self.say(
            f"{name} exited unexpectedly ({how}); restarting it in {w.due - now:.1f} s "
            f"(crash {n} of at most {self.policy.max_crashes - 1} within "
            f"{self.policy.window:.0f} s); see {log_path}"
        )

    def _maybe_start(self, name: str, now: float, child: Child | None) -> None:
        w = self.watch.get(name)
        if w is None or w.due is None or now < w.due:
            return
        w.due = None
        w.starts += 1
        self.restarts += 1
        if child is None:
            assert self.etcd is not None
            try:
                self.etcd.start()  # same ports, same data dir; waits until healthy
            except EtcdStartError as e:
                self.say(f"etcd did not come back: {e}")
                self._exited(name, "did not start", self.clock(), self.etcd.log_path)
                return
            self.say(f"etcd restarted (start {w.starts}) on {self.etcd.endpoint}")
            return
        with open(child.log_path, "ab") as f:
            f.write(f"\n--- restarted by the supervisor (start {w.starts}) ---\n".encode())
        if name != "gateway":  # every other child prints READY once it serves
            w.ready_from = child.log_path.stat().st_size
        self.relaunch(child)
        if child.name.startswith(("prefill", "decode")):
            child.address = ""  # a worker binds a new port; it prints it with READY
        self.say(f"{name} restarted (start {w.starts}, pid {child.pid})")

    def _check_ready(self, name: str, child: Child) -> None:
        """Report a restarted worker once it printed READY (with its new address)."""
        w = self.watch.get(name)
        if w is None or w.ready_from < 0:
            return
        with open(child.log_path, "rb") as f:
            f.seek(w.ready_from)
            tail = f.read().decode(errors="replace")
        if "READY" in tail:
            w.ready_from = -1
            line = tail[tail.index("READY") :].splitlines()[0]
            child.address = child.address or line.split()[-1]
            serving(child)
            self.say(f"{name} is serving again at {child.address}")

    def run(self, stopping: Callable[[], bool], interval: float = 0.2) -> None:
        """``poll`` every ``interval`` s until ``stopping()``."""
        while not stopping():
            self.poll()
            time.sleep(interval)
