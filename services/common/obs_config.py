"""Metrics and tracing settings that every service shares: flags with ``TANDEM_*`` environment
fallbacks, parsed into a frozen `ObservabilityConfig` (stdlib only, so configs may embed it).

- ``--metrics-host`` (``TANDEM_METRICS_HOST``, default 127.0.0.1) and ``--metrics-port``
  (``TANDEM_METRICS_PORT``, default 0 = no metrics server): where ``/metrics`` is served, always
  apart from the service's own port.
- ``--otlp-endpoint`` (``TANDEM_OTLP_ENDPOINT``, else the standard
  ``OTEL_EXPORTER_OTLP_ENDPOINT``): export spans over OTLP/gRPC; unset, tracing is off.
- ``--trace-file`` (``TANDEM_TRACE_FILE``): also append finished spans to a JSON-lines file.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """Where a process serves metrics and sends traces."""

    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: no metrics server
    otlp_endpoint: str = ""
    trace_file: str = ""

    @property
    def metrics_enabled(self) -> bool:
        return self.metrics_port > 0


def add_observability_flags(
    p: argparse.ArgumentParser, env: Mapping[str, str] | None = None
) -> None:
    """The metrics and tracing flags (see the module docstring)."""
    env = os.environ if env is None else env
    g = p.add_argument_group("metrics and tracing")
    g.add_argument("--metrics-host", default=env.get("TANDEM_METRICS_HOST", "127.0.0.1"))
    g.add_argument(
        "--metrics-port",
        type=int,
        default=int(env.get("TANDEM_METRICS_PORT", "0") or 0),
        help="serve Prometheus /metrics on this port (0: off)",
    )
    g.add_argument(
        "--otlp-endpoint",
        default=env.get("TANDEM_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        help="OTLP/gRPC endpoint for traces, e.g. http://otel-collector:4317 (unset: off)",
    )
    g.add_argument(
        "--trace-file",
        default=env.get("TANDEM_TRACE_FILE", ""),
        help="append finished spans to this JSON-lines file",
    )


def observability_config(args: argparse.Namespace) -> ObservabilityConfig:
    return ObservabilityConfig(
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        otlp_endpoint=args.otlp_endpoint,
        trace_file=args.trace_file,
    )
