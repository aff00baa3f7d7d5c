"""Metrics and tracing settings that every service shares, declared as options
(`services.common.options`): stdlib only, so every service's config embeds it.

- ``--metrics-host`` / ``--metrics-port`` (0 = no metrics server): where ``/metrics`` is served,
  always apart from the service's own port.
- ``--otlp-endpoint`` (``TANDEM_OTLP_ENDPOINT``, else the standard
  ``OTEL_EXPORTER_OTLP_ENDPOINT``): export spans over OTLP/gRPC; unset, tracing is off.
- ``--trace-file``: also append finished spans to a JSON-lines file.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.options import option


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """Where a process serves metrics and sends traces."""

    metrics_host: str = option("127.0.0.1", "address of the Prometheus /metrics server")
    metrics_port: int = option(0, "serve Prometheus /metrics on this port (0: off)")
    otlp_endpoint: str = option(
        "",
        "OTLP/gRPC endpoint for traces, e.g. http://otel-collector:4317 (unset: off)",
        also_env=("OTEL_EXPORTER_OTLP_ENDPOINT",),
    )
    trace_file: str = option("", "append finished spans to this JSON-lines file")

    @property
    def metrics_enabled(self) -> bool:
        return self.metrics_port > 0
