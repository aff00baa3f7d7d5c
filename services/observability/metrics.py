"""Prometheus metrics shared by every service: one registry per process, the constant labels
(``component``, ``model``, ``worker``) added to every sample, the ``/metrics`` HTTP server, and the
metrics that more than one service exports (gRPC server latency, etcd errors, KV transfers).

prometheus_client is the one metrics library of the project (see README "Metrics and
dashboards"); the engine and libkv never import it: they expose plain counters and callbacks that
the collectors here read at scrape time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from libkv.cluster.etcd_follow import ERRORS

log = logging.getLogger(__name__)

# Latencies from 5 ms to 60 s (TTFT, ITL, TPOT, end to end, queue, step, transfer, gRPC).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0,
)  # fmt: skip
# A KV hand-off: a GPU copy takes a fraction of a millisecond, a network path up to seconds
# (the latency buckets start at 5 ms, where every same-host hand-off would land at once).
HANDOFF_BUCKETS = (
    0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Batch sizes in sequences or tokens.
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Etcd operations whose errors are counted (every one retries with backoff).
ETCD_OPS = ("register", "watch", "locations")
CONST_LABELS = ("component", "model", "worker")


class ConstLabels(Collector):
    """Every sample of ``inner`` with ``labels`` added: each process's metrics carry its
    component (gateway, router, prefill, decode), model and worker (instance id), which the
    dashboards' template variables select on wherever Prometheus runs."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self.inner = inner
        self.labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield out


class Metrics:
    """One process's metrics registry. Metric objects register on ``registry``; ``serve``
    exposes them (with the constant labels) on ``/metrics``."""

    def __init__(self, component: str, model: str, worker: str, version: str = "") -> None:
        disable_created_metrics()  # no *_created series: Prometheus does not need them
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"component": component, "model": model, "worker": worker}
        info = Info("tandem_build", "Tandem build of this process (value 1).",
                    registry=self.registry)  # fmt: skip
        info.info({"version": version or _version()})
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def exposition(self) -> CollectorRegistry:
        """The registry that ``/metrics`` serves: ``registry`` with the constant labels."""
        outer = CollectorRegistry(auto_describe=False)
        outer.register(ConstLabels(self.registry, self.labels))
        return outer

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) from a daemon thread; returns the
        bound port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.exposition())
        self.port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def register(self, collector: Collector) -> None:
        """Add a scrape-time collector (gauges read from live objects)."""
        self.registry.register(collector)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:
        return "dev"


class GrpcServerMetrics:
    """``tandem_grpc_server_handling_seconds{method,code}``: time from a call's start to its
    last response message (streams included), by final status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handling = Histogram(
            "tandem_grpc_server_handling_seconds",
            "gRPC server calls: time from the start of a call to its end, by method and status.",
            ["method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.handling.labels(method, code).observe(seconds)


class EtcdErrorsCollector(Collector):
    """``tandem_etcd_errors_total{op}``: failed etcd operations of this process (libkv counts
    them in `libkv.cluster.etcd_follow.ERRORS`; each is retried with backoff)."""

    def collect(self) -> Iterator[Metric]:
        totals = dict.fromkeys(ETCD_OPS, 0)
        totals.update(dict.copy(ERRORS))  # dict.copy: atomic under the GIL
        family = CounterMetricFamily(
            "tandem_etcd_errors", "Failed etcd operations (each is retried), by operation.",
            labels=["op"],
        )  # fmt: skip
        for op, n in sorted(totals.items()):
            family.add_metric([op], n)
        yield family


@dataclass(slots=True)
class KVTransferMetrics:
    """KV blocks obtained by a decode worker, per transport (``nixl-read``, ``nixl-write``,
    ``grpc``): counted by `libkv.transfer.observed.ObservedTransport`."""

    transfers: Counter
    blocks: Counter
    bytes: Counter
    failures: Counter
    duration: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> KVTransferMetrics:
        by = ["transport"]
        return cls(
            transfers=Counter("tandem_kv_transfers", "Completed KV transfers.", by,
                              registry=registry),
            blocks=Counter("tandem_kv_transfer_blocks", "KV blocks transferred.", by,
                           registry=registry),
            bytes=Counter("tandem_kv_transfer_bytes", "KV bytes transferred.", by,
                          registry=registry),
            failures=Counter("tandem_kv_transfer_failures", "KV transfers that failed.", by,
                             registry=registry),
            duration=Histogram(
                "tandem_kv_transfer_duration_seconds",
                "Time to obtain a request's KV blocks from the prefill worker.",
                by,
                buckets=HANDOFF_BUCKETS,
                registry=registry,
            ),
        )  # fmt: skip

    def init(self, transport: str) -> None:
        """Create the series of ``transport`` at zero, so rates and ratios exist from the start."""
        for c in (self.transfers, self.blocks, self.bytes, self.failures):
            c.labels(transport)
        self.duration.labels(transport)

    def done(self, transport: str, blocks: int, nbytes: int, seconds: float) -> None:
        self.transfers.labels(transport).inc()
        self.blocks.labels(transport).inc(blocks)
        self.bytes.labels(transport).inc(nbytes)
        self.duration.labels(transport).observe(seconds)

    def failed(self, transport: str) -> None:
        self.failures.labels(transport).inc()


class AdmissionCollector(Collector):
    """`services.common.admission.TokenLedger`s at scrape time, summed (the gateway keeps one
    per base model): tokens admitted and in flight, the bound (0: none) and requests refused
    (429 / RESOURCE_EXHAUSTED) by priority."""

    def __init__(self, *ledgers: Any) -> None:
        self.ledgers = ledgers

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "tandem_admission_pending_tokens",
            "Tokens (prompt + booked completion tokens; prefill: prompt) of the requests "
            "admitted and running.",
            value=sum(led.pending_tokens for led in self.ledgers),
        )
        yield GaugeMetricFamily(
            "tandem_admission_limit_tokens",
            "The admission bound in tokens (0: unbounded).",
            value=sum(led.max_tokens for led in self.ledgers),
        )
        refused = CounterMetricFamily(
            "tandem_admission_refused",
            "Requests refused at the admission bound, by priority.",
            labels=["priority"],
        )
        totals: dict[str, int] = {}
        for led in self.ledgers:
            for priority, n in dict.copy(led.refused).items():
                totals[priority] = totals.get(priority, 0) + n
        for priority, n in sorted(totals.items()):
            refused.add_metric([priority], n)
        yield refused


class KVPathCollector(Collector):
    """A GPU worker's KV hand-off paths at scrape time (`libkv.transfer.setup.KVSide`):
    which can move its GPU memory device-direct, and transfers caught on a slow path. Nothing
    for a host-memory pool."""

    def __init__(self, side: Any) -> None:
        self.side = side

    def collect(self) -> Iterator[Metric]:
        if not self.side.gpu_direct:
            return
        paths = GaugeMetricFamily(
            "tandem_kv_gpu_direct",
            "1 when the path moves this worker's GPU KV device-direct (cuda-ipc: peers on this "
            "host; network: NIXL over NVLink/RDMA), 0 when it cannot (no pairing over it).",
            labels=["path"],
        )
        for path, ok in sorted(self.side.gpu_direct.items()):
            paths.add_metric([path], 1.0 if ok else 0.0)
        yield paths
        yield CounterMetricFamily(
            "tandem_kv_slow_transfers",
            "GPU KV transfers caught on an emulated or TCP path (NIXL is not used for GPU "
            "memory after one).",
            value=self.side.slow_transfers,
        )


class HandoffCollector(Collector):
    """A decode worker's hand-offs that fell back to computing the prompt itself
    (`services.decode.core.DecodeCore.recomputed`): its KV did not arrive."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "tandem_kv_handoff_recomputed",
            "Prefilled requests whose KV did not arrive, so the decode worker recomputed the "
            "prompt.",
            value=self.core.recomputed,
        )
        yield CounterMetricFamily(
            "tandem_kv_transfer_corrupt_blocks",
            "KV blocks that arrived with a checksum other than the sender's (their prompt was "
            "recomputed; corrupt KV is never served).",
            value=self.core.corrupt_blocks,
        )
        yield CounterMetricFamily(
            "tandem_kv_transfer_fused_checks",
            "KV transfers checked by the sums their copy took as it moved the blocks (CUDA IPC "
            "with wsum64: compared on the GPU, no second read of the blocks).",
            value=getattr(self.core, "fused_checks", 0),
        )
