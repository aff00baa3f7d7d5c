"""What every service shares: the option helper (``options``), starting a gRPC server with
health, reflection and one error interceptor (``grpc_server``, ``errors``), live and ready
(``health``), dialling another service (``channels``), TLS and etcd security (``tls``,
``security``), admission in tokens (``admission``), the shared message conversions
(``codec``) and a process's logging and signals (``process``)."""
