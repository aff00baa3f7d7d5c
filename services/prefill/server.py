"""gRPC servicers of a prefill worker: decode message -> call core -> encode reply.

Calls that take the engine lock run in a worker thread (``AsyncEngine.run``): the engine holds
it for a whole model step, and the event loop must keep serving meanwhile."""

from __future__ import annotations

from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from services.common.codec import priority_from_pb, sampling_from_pb, stats_to_pb
from services.prefill.codec import prefill_response
from services.prefill.core import PrefillCore


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, core: PrefillCore) -> None:
        self.core = core

    async def Prefill(self, request, context):  # noqa: N802 - generated name
        result = await self.core.prefill(
            request.request_id,
            list(request.token_ids),
            sampling_from_pb(request.sampling),
            request.tenant,
            priority_from_pb(request.priority),
        )
        return prefill_response(result)

    async def Release(self, request, context):  # noqa: N802
        found = await self.core.engine.run(self.core.release, request.request_id)
        return worker_pb2.ReleaseResponse(found=found)

    async def Abort(self, request, context):  # noqa: N802
        found = await self.core.engine.run(self.core.abort, request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def Stats(self, request, context):  # noqa: N802
        return await self.core.engine.run(
            worker_stats, self.core.engine.engine, self.core, "prefill"
        )


class KVTransportServicer(worker_pb2_grpc.KVTransportServicer):
    def __init__(self, core: PrefillCore) -> None:
        self.core = core

    async def PullBlocks(self, request, context):  # noqa: N802
        data = await self.core.engine.run(
            self.core.read_blocks, request.request_id, request.incarnation, list(request.block_ids)
        )
        for i, raw in enumerate(data):
            yield worker_pb2.BlockChunk(index=i, data=raw)


def worker_stats(engine, core, role: str) -> common_pb2.WorkerStats:
    try:
        engine.check_integrity()
        ok = True
    except AssertionError:
        ok = False
    return stats_to_pb(
        engine.stats(),
        worker_id=core.worker_id,
        incarnation=core.incarnation,
        role=role,
        held=engine.num_held,
        ok=ok,
        locations=getattr(engine.kv.listener, "stats", None),  # a SummaryPublisher's
    )
