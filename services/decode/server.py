"""gRPC servicer of a decode worker."""

from __future__ import annotations

from tandem.v1 import common_pb2, worker_pb2_grpc

from services.common.codec import event_from_output, event_to_pb
from services.decode.codec import job_from_pb
from services.decode.core import DecodeCore
from services.prefill.server import worker_stats


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, core: DecodeCore) -> None:
        self.core = core

    async def Generate(self, request, context):  # noqa: N802 - generated name
        job = job_from_pb(request)
        async for out in self.core.generate(job):
            ev = event_from_output(out)
            if out.finished and job.kv is not None:
                ev.completion_tokens = len(out.token_ids)
                ev.cached_tokens = max(job.cached_tokens, out.num_cached_tokens)
            yield event_to_pb(ev)

    async def Abort(self, request, context):  # noqa: N802
        found = await self.core.engine.run(self.core.abort, request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def Stats(self, request, context):  # noqa: N802
        return await self.core.engine.run(
            worker_stats, self.core.engine.engine, self.core, "decode"
        )
