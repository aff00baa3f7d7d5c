"""Starting a process's metrics registry (and its ``/metrics`` server) and tracing from its
`services.observability.config.ObservabilityConfig`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.observability import tracing
from services.observability.config import ObservabilityConfig
from services.observability.metrics import EtcdErrorsCollector, GrpcServerMetrics, Metrics

log = logging.getLogger(__name__)


@dataclass
class Observability:
    """A process's metrics registry (served when configured) and tracer provider."""

    metrics: Metrics
    grpc: GrpcServerMetrics
    tracing: tracing.Tracing = field(default_factory=tracing.Tracing)

    @classmethod
    def start(
        cls,
        config: ObservabilityConfig,
        component: str,
        model: str,
        worker: str,
        etcd: bool = True,
    ) -> Observability:
        """Set up tracing (before any channel is made: channels pick their interceptors then)
        and the metrics registry with the gRPC server histogram and (``etcd``) the etcd error
        counts; serve ``/metrics`` when a port is configured."""
        tr = tracing.setup_tracing(
            component,
            config.otlp_endpoint,
            config.trace_file,
            **{"service.instance.id": worker, "tandem.model": model},
        )
        metrics = Metrics(component, model, worker)
        grpc_metrics = GrpcServerMetrics(metrics.registry)
        if etcd:
            metrics.register(EtcdErrorsCollector())
        if config.metrics_enabled:
            metrics.serve(config.metrics_host, config.metrics_port)
        return cls(metrics, grpc_metrics, tr)

    def stop(self) -> None:
        self.metrics.stop()
        self.tracing.shutdown()
