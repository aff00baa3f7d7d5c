"""Membership and block locations: what workers and routers tell each other through etcd.

``registry`` (members under leases, watched by routers), ``locations`` (the cached prefixes a
worker publishes under its lease) and ``location_index`` (a router's index of them), over
``etcd_follow`` (connections, watches that survive etcd restarts) and ``keepalive`` (leases kept
from their own thread). The pure bookkeeping these describe (block pool, KV manager, hash chain)
stays in ``libkv`` itself and knows nothing of etcd.
"""
