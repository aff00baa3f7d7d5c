"""gRPC servicer of a prefill worker: decode message -> call core -> encode reply. (Its
``tandem.v1.KVTransport`` is the gRPC block stream, `libkv.transfer.grpc_stream`.)"""

from __future__ import annotations

from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from services.common.codec import priority_from_pb, sampling_from_pb
from services.prefill.codec import prefill_response
from services.prefill.core import PrefillCore
from services.worker.codec import stats_to_pb
from services.worker.embed import embed, prompt_logprobs


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
            request.lora,
            request.slo.ttft_ms,
        )
        return prefill_response(result)

    async def Release(self, request, context):  # noqa: N802
        found = await self.core.release_request(request.request_id)
        return worker_pb2.ReleaseResponse(found=found)

    async def Abort(self, request, context):  # noqa: N802
        found = await self.core.abort_request(request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def Stats(self, request, context):  # noqa: N802
        return stats_to_pb(await self.core.stats())

    async def Embed(self, request, context):  # noqa: N802
        return await embed(self.core.engine, self.core.ledger, request)

    async def PromptLogprobs(self, request, context):  # noqa: N802
        return await prompt_logprobs(self.core.engine, self.core.ledger, request)
