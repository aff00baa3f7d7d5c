"""``python -m services.prefill``: a prefill worker (the worker runtime plus its core,
servicers and the serving side of the KV hand-off)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from tandem.v1 import worker_pb2_grpc

from libkv.transfer.grpc_stream import BlockStreamServicer
from libkv.transfer.setup import prefill_side
from services.prefill.core import PrefillCore
from services.prefill.server import PrefillServicer
from services.worker import config as worker_config
from services.worker import runtime, switch

parse_config = functools.partial(worker_config.parse_config, "prefill")  # (argv, env)


async def wire(w: runtime.Worker) -> runtime.Role:
    c = w.config
    core = PrefillCore(
        w.engine, c.worker_id, w.incarnation, c.lease_seconds, w.ledger, c.kv_checksums,
        w.gate(),
    )  # fmt: skip
    kv = await prefill_side(
        c.kv_transport,
        w.pool,
        c.worker_id,
        w.incarnation,
        c.etcd,
        holder=core,
        busy=lambda: core.num_held > 0,
        cuda_ipc=c.handoff_cuda_ipc,
        ranks=w.rank_agents(),
    )

    def bound(address: str) -> None:
        core.address = address  # KV handles name it
        core.start()

    return runtime.Role(
        servicers=[
            (worker_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(core)),
            (worker_pb2_grpc.add_KVTransportServicer_to_server, BlockStreamServicer(core)),
        ],
        service_names=["tandem.v1.Prefill", "tandem.v1.KVTransport"],
        kv=kv,
        # Prefills in flight, and finished ones whose KV no decode worker has pulled yet.
        busy=lambda: len(core.ledger.inflight) + core.num_held,
        bound=bound,
        stop=core.stop,
    )


def main(argv: Sequence[str] | None = None) -> None:
    switch.main("prefill", wire, argv)


if __name__ == "__main__":
    main()
