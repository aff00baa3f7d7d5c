"""``python -m services.decode``: a decode worker (the worker runtime plus its core, servicer
and the receiving side of the KV hand-off)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from tandem.v1 import worker_pb2_grpc

from libkv.transfer.grpc_stream import BlockStreamServicer
from libkv.transfer.observed import ObservedTransport
from libkv.transfer.setup import decode_side
from services.decode.core import DecodeCore
from services.decode.server import DecodeServicer
from services.observability import tracing
from services.observability.metrics import HandoffCollector, KVTransferMetrics
from services.worker import config as worker_config
from services.worker import runtime, switch

parse_config = functools.partial(worker_config.parse_config, "decode")  # (argv, env)


async def wire(w: runtime.Worker) -> runtime.Role:
    c = w.config
    kv = await decode_side(
        c.kv_transport, c.nixl_mode, w.pool, c.worker_id, w.incarnation, c.etcd, w.channel,
        c.handoff_cuda_ipc, layout=w.engine.info.layout, ranks=w.rank_agents(),
        checksums=c.kv_checksums, fault=c.kv_fault,
    )  # fmt: skip
    assert kv.transport is not None
    transport = ObservedTransport(
        kv.transport,
        KVTransferMetrics.create(w.obs.metrics.registry),
        span=lambda name, attributes: tracing.span(name, attributes=attributes),
    )
    core = DecodeCore(
        w.engine,
        transport,
        c.worker_id,
        w.incarnation,
        transfer_timeout=c.kv_transfer_timeout,
        on_transfer_failure=c.on_transfer_failure,
        ledger=w.ledger,
        fault=c.kv_fault,
        checksums=c.kv_checksums,
        gate=w.gate(),
        stream_interval=c.stream_interval,
    )

    # Moved KV (a drain's live migration) is READ over NIXL where this worker runs an agent.
    kv.serve_held(core.handover, busy=lambda: core.handover.num_held > 0)

    def bound(address: str) -> None:
        core.handover.address = address  # moved requests' KV handles name it

    return runtime.Role(
        servicers=[
            (worker_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(core)),
            (worker_pb2_grpc.add_KVTransportServicer_to_server, BlockStreamServicer(core.handover)),
        ],
        service_names=["tandem.v1.Decode", "tandem.v1.KVTransport"],
        kv=kv,
        # Running streams finish or move with their KV (up to the drain timeout), and moved
        # KV is read by the workers taking over; aborts still reach them.
        busy=lambda: len(core.ledger.inflight) + core.handover.num_held,
        bound=bound,
        hand_over=core.move_out,
        collectors=[HandoffCollector(core)],
    )


def main(argv: Sequence[str] | None = None) -> None:
    switch.main("decode", wire, argv)


if __name__ == "__main__":
    main()
