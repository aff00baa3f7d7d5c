"""gRPC servicer of the router: one routing core per base model it serves."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

import grpc
from tandem.v1 import common_pb2, router_pb2_grpc

from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.sampling_params import MAX_TOP_LOGPROBS
from engine.tokenizer import Tokenizer
from services.common.codec import event_to_pb, logprob_to_pb
from services.common.errors import Unauthenticated
from services.observability import tracing
from services.router.codec import job_from_pb
from services.router.core import RouterCore
from services.router.legs import CallerLegs


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self, routes: Mapping[str, tuple[RouterCore, Tokenizer]], api_keys: frozenset[str]
    ) -> None:
        """``routes``: served base model -> (its core, its tokenizer); the first is the
        default of a request that names no model."""
        self.routes = dict(routes)
        self.default = next(iter(self.routes))
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

    def _resolve(self, model: str) -> tuple[str, str]:
        """(base model, adapter or "") that a request's ``model`` names; NOT_FOUND else."""
        if not model or model in self.routes:
            return model or self.default, ""
        for base, (core, _) in self.routes.items():
            if model in core.adapters():
                return base, model
        raise AdapterNotFoundError(f"The model `{model}` does not exist.")

    def _base(self, name: str) -> str:
        """The base model an adapter load names (only one base model: that one)."""
        if len(self.routes) == 1:
            return self.default
        base, sep, _ = name.partition("/")
        if sep and base in self.routes:
            return base
        raise InvalidRequestError(
            f"this router serves {len(self.routes)} base models: name the adapter "
            f"BASE/NAME, BASE one of {', '.join(self.routes)}"
        )

    async def Generate(self, request, context):  # noqa: N802 - generated name
        self._authorize(context)
        base, lora = self._resolve(request.model)
        core, tokenizer = self.routes[base]
        rid = request.request_id or core.new_request_id()
        job = job_from_pb(request, tokenizer, rid, context.time_remaining(), lora)
        async for ev in core.generate(job):
            yield event_to_pb(ev)

    async def Route(self, request_iterator, context):  # noqa: N802
        """Generate with the decode legs made by the caller (`services.router.legs`)."""
        self._authorize(context)
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("report") != "request":
            raise InvalidRequestError("Route's first message carries the request")
        request = first.request
        base, lora = self._resolve(request.model)
        core, tokenizer = self.routes[base]
        rid = request.request_id or core.new_request_id()
        legs = CallerLegs(context)
        job = job_from_pb(request, tokenizer, rid, context.time_remaining(), lora, legs)
        with tracing.request_context(rid):
            tracing.annotate_request(rid)
            async for ev in core.generate(job):
                if not ev.delivered:
                    await legs.send(ev)

    async def Abort(self, request, context):  # noqa: N802
        self._authorize(context)
        found = any(core.abort(request.request_id) for core, _ in self.routes.values())
        return common_pb2.AbortResponse(found=found)

    async def LoadLoraAdapter(self, request, context):  # noqa: N802
        self._authorize(context)
        name = request.lora_name
        if not name or name in self.routes or "," in name:
            raise InvalidRequestError(f"invalid adapter name {name!r}")
        if not request.lora_path:
            raise InvalidRequestError("lora_path is required")
        core = self.routes[self._base(name)][0]
        ids = await core.load_lora(name, request.lora_path)
        return common_pb2.LoraAdapterResponse(worker_ids=ids)

    async def UnloadLoraAdapter(self, request, context):  # noqa: N802
        self._authorize(context)
        base, lora = self._resolve(request.lora_name)
        if not lora:
            raise InvalidRequestError(f"`{request.lora_name}` is a base model, not an adapter")
        ids = await self.routes[base][0].unload_lora(lora)
        return common_pb2.LoraAdapterResponse(worker_ids=ids)

    async def Embed(self, request, context):  # noqa: N802
        core, lora, rid, inputs = self._prompts(request, context, "embed")
        vectors, tokens = await core.embed(rid, inputs, lora)
        reply = common_pb2.EmbedResponse(prompt_tokens=tokens)
        for v in vectors:
            reply.embeddings.add(values=v)
        return reply

    async def PromptLogprobs(self, request, context):  # noqa: N802
        core, lora, rid, inputs = self._prompts(request, context, "score")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {request.top_logprobs})"
            )
        scored, tokens = await core.prompt_logprobs(rid, inputs, request.top_logprobs, lora)
        reply = common_pb2.PromptLogprobsResponse(prompt_tokens=tokens)
        for lps in scored:
            reply.prompts.add(tokens=[logprob_to_pb(lp) for lp in lps])
        return reply

    def _prompts(self, request, context, what: str) -> tuple[RouterCore, str, str, list[list[int]]]:
        """(the model's router core, the adapter, the request id, the prompts) of prefill-only
        work (Embed, PromptLogprobs), once the caller is authorized and every prompt has a
        token."""
        self._authorize(context)
        base, lora = self._resolve(request.model)
        core = self.routes[base][0]
        inputs = [list(i.token_ids) for i in request.inputs]
        if not inputs or any(not ids for ids in inputs):
            raise InvalidRequestError(f"every input to {what} needs at least one token")
        return core, lora, request.request_id or core.new_request_id(), inputs

    async def ListModels(self, request, context):  # noqa: N802
        self._authorize(context)
        models = [common_pb2.ModelInfo(id=base) for base in self.routes]
        for base, (core, _) in self.routes.items():
            models += [common_pb2.ModelInfo(id=n, parent=base) for n in core.adapters()]
        return common_pb2.ListModelsResponse(models=models)
