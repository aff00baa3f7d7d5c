"""gRPC servicer of a decode worker: decode message -> call core -> encode reply."""

from __future__ import annotations

from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from services.common.codec import Event, Moved, event_to_pb, priority_from_pb
from services.decode.codec import job_from_pb, output_to_pb
from services.decode.core import DecodeCore
from services.worker.codec import stats_to_pb
from services.worker.embed import embed, prompt_logprobs

DEFAULT_LEASE_MS = 60_000  # a Reserve that names no lease


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, core: DecodeCore) -> None:
        self.core = core

    async def Generate(self, request, context):  # noqa: N802 - generated name
        job = job_from_pb(request)
        async for out in self.core.generate(job):
            if isinstance(out, Moved):  # draining: the request goes on elsewhere from this KV
                yield event_to_pb(Event(job.request_id, moved=out))
                return
            yield output_to_pb(out, job)

    async def Reserve(self, request, context):  # noqa: N802
        lease = (request.lease_ms or DEFAULT_LEASE_MS) / 1000
        self.core.reserve(
            request.request_id, request.tokens, priority_from_pb(request.priority), lease,
            request.slo.tpot_ms,
        )  # fmt: skip
        return worker_pb2.ReserveResponse()

    async def Unreserve(self, request, context):  # noqa: N802
        return worker_pb2.UnreserveResponse(found=self.core.unreserve(request.request_id))

    async def Abort(self, request, context):  # noqa: N802
        found = await self.core.abort_request(request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def Stats(self, request, context):  # noqa: N802
        return stats_to_pb(await self.core.stats())

    async def Embed(self, request, context):  # noqa: N802
        return await embed(self.core.engine, self.core.ledger, request)

    async def PromptLogprobs(self, request, context):  # noqa: N802
        return await prompt_logprobs(self.core.engine, self.core.ledger, request)
