"""Membership and block locations: what workers and routers tell each other through etcd.

``registry`` (members under leases, watched by routers; ``keepalive`` keeps leases from a
thread of their own) over ``etcd_follow`` (connections, watches that survive etcd restarts).
Block locations: each worker publishes a bounded summary of its prefix cache
(``summary_publisher``, deciding what to write in ``summary_state``, encoded by
``location_summary``) and routers index them (``summary_index``), remembering their own recent
routes meanwhile (``recent_routes``). ``adapters``: the LoRA adapters loaded at
run time, kept (without a lease) for workers that start later. The pure bookkeeping these describe
(block pool, KV manager, hash chain) stays in ``libkv`` itself and knows nothing of etcd.
"""
