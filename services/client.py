"""Typed async client of the router's internal gRPC API, for platforms that skip HTTP.

from services.client import TandemClient

async with TandemClient("127.0.0.1:50051", api_key="secret") as client:
    async for ev in client.generate("Once upon a time", max_tokens=32, temperature=0):
        print(ev.text, end="")
    done = await client.complete([1, 2, 3], max_tokens=8)
    print(done.text, done.finish_reason, done.usage)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc

from engine.sampling_params import SamplingParams
from services.common.codec import Event, event_from_pb, sampling_to_pb


class TandemClientError(Exception):
    """The router refused or failed the request; ``code`` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # a stop string, a stop token's id, or None
    logprobs: list = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)


class TandemClient:
    """Async client of ``tandem.v1.Router``; keeps one channel, safe to share across tasks."""

    def __init__(self, address: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        tenant: str = "",
        model: str = "",
        **sampling,
    ) -> AsyncIterator[Event]:
        """Stream events; ``sampling`` takes SamplingParams fields (validated client-side)."""
        req = router_pb2.GenerateRequest(
            request_id=request_id or f"client-{uuid.uuid4().hex}",
            sampling=sampling_to_pb(SamplingParams(**sampling)),
            tenant=tenant,
            model=model,
        )
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        call = self._stub.Generate(req, metadata=self._metadata, timeout=self.timeout)
        try:
            async for msg in call:
                yield event_from_pb(msg)
        except grpc.aio.AioRpcError as e:
            raise TandemClientError(e.code().name, e.details() or "") from e
        except asyncio.CancelledError:
            # grpc.aio reports a call cancelled by the *server* (an Abort) as CancelledError;
            # only a cancellation of the caller's own task should look like one.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise TandemClientError("CANCELLED", "the request was aborted") from None
        finally:
            call.cancel()  # no-op when done; aborts the request if the caller stopped early

    async def complete(self, prompt: str | Sequence[int], **kw) -> Completion:
        """Run to completion and gather the stream (one choice: use ``generate`` for n > 1)."""
        if kw.get("n", 1) != 1:
            raise ValueError("complete() gathers one choice; iterate generate() for n > 1")
        out: Completion | None = None
        async for ev in self.generate(prompt, **kw):
            out = out or Completion(ev.request_id)
            out.text += ev.text
            out.token_ids += ev.token_ids
            out.logprobs += ev.logprobs
            if ev.finish_reason is not None:
                out.finish_reason, out.stop_reason = ev.finish_reason, ev.stop_reason
                out.usage = Usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
        if out is None:
            raise TandemClientError("UNKNOWN", "the stream ended without events")
        return out

    async def abort(self, request_id: str) -> bool:
        try:
            resp = await self._stub.Abort(
                common_pb2.AbortRequest(request_id=request_id), metadata=self._metadata, timeout=10
            )
        except grpc.aio.AioRpcError as e:
            raise TandemClientError(e.code().name, e.details() or "") from e
        return resp.found

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> TandemClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
