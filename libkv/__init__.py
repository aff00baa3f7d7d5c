"""The KV cache as data, in three rooms: the bookkeeping (``block_pool``, ``kv_manager``,
``hashing``: no torch, no etcd, no grpc), membership and block locations in etcd
(``libkv.cluster``) and moving blocks between workers (``libkv.transfer``, behind the
``KVTransport`` Protocol)."""
