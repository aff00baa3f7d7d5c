"""The runtime prefill and decode workers share: config (``config``), the process's life from
engine start to drain and stop (``runtime``), registration and block locations in etcd
(``presence``) and the Stats they report (``stats``, ``codec``). Each role adds only its core,
servicers and KV side (``services.prefill``, ``services.decode``)."""
