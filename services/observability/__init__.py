"""What every service measures and traces: Prometheus metrics (``metrics``, ``engine`` for the
workers' engines), OpenTelemetry traces (``tracing``), the gRPC server interceptor that does
both per call (``grpc``), their settings (``config``) and starting them in a process
(``process``)."""
