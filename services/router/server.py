"""gRPC servicer of the router."""

from __future__ import annotations

import hashlib
import hmac

from tandem.v1 import common_pb2, router_pb2_grpc

from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.tokenizer import Tokenizer
from services.common.codec import event_to_pb
from services.common.errors import Unauthenticated
from services.router.codec import job_from_pb
from services.router.core import RouterCore


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self, core: RouterCore, tokenizer: Tokenizer, model: str, api_keys: frozenset[str]
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.model = model
        self.api_keys = api_keys

    def _authorize(self, context) -> None:
        if not self.api_keys:
            return
        meta = dict(context.invocation_metadata() or ())
        token = meta.get("authorization", "").removeprefix("Bearer ").strip()
        digest = hashlib.sha256(token.encode()).hexdigest().encode()
        # api_keys holds SHA-256 hex digests; compare with all of them in constant time.
        found = False
        for stored in self.api_keys:
            found |= hmac.compare_digest(stored.encode(), digest)
        if not token or not found:
            raise Unauthenticated("missing or wrong API key in 'authorization' metadata")

    def _lora_of(self, model: str) -> str:
        """The adapter a request's ``model`` names ("" for the base model or none given)."""
        if not model or model == self.model:
            return ""
        if model in self.core.adapters():
            return model
        raise AdapterNotFoundError(f"The model `{model}` does not exist.")

    async def Generate(self, request, context):  # noqa: N802 - generated name
        self._authorize(context)
        lora = self._lora_of(request.model)
        rid = request.request_id or self.core.new_request_id()
        job = job_from_pb(request, self.tokenizer, rid, context.time_remaining(), lora)
        async for ev in self.core.generate(job):
            yield event_to_pb(ev)

    async def Abort(self, request, context):  # noqa: N802
        self._authorize(context)
        return common_pb2.AbortResponse(found=self.core.abort(request.request_id))

    async def LoadLoraAdapter(self, request, context):  # noqa: N802
        self._authorize(context)
        name = request.lora_name
        if not name or name == self.model or "," in name:
            raise InvalidRequestError(f"invalid adapter name {name!r}")
        if not request.lora_path:
            raise InvalidRequestError("lora_path is required")
        ids = await self.core.load_lora(name, request.lora_path)
        return common_pb2.LoraAdapterResponse(worker_ids=ids)

    async def UnloadLoraAdapter(self, request, context):  # noqa: N802
        self._authorize(context)
        ids = await self.core.unload_lora(request.lora_name)
        return common_pb2.LoraAdapterResponse(worker_ids=ids)

    async def Embed(self, request, context):  # noqa: N802
        self._authorize(context)
        lora = self._lora_of(request.model)
        inputs = [list(i.token_ids) for i in request.inputs]
        if not inputs or any(not ids for ids in inputs):
            raise InvalidRequestError("every input to embed needs at least one token")
        rid = request.request_id or self.core.new_request_id()
        vectors, tokens = await self.core.embed(rid, inputs, lora)
        reply = common_pb2.EmbedResponse(prompt_tokens=tokens)
        for v in vectors:
            reply.embeddings.add(values=v)
        return reply

    async def ListModels(self, request, context):  # noqa: N802
        self._authorize(context)
        models = [common_pb2.ModelInfo(id=self.model)]
        models += [common_pb2.ModelInfo(id=n, parent=self.model) for n in self.core.adapters()]
        return common_pb2.ListModelsResponse(models=models)
