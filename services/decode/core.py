"""Decode logic (no grpc): obtain the prompt's KV (or prefill it locally), join the running
batch, stream outputs."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from engine.llm_engine import RequestOutput
from engine.sampler import TokenLogprob
from engine.sampling_params import SamplingParams
from libkv.transfer import KVTransferError, KVTransport
from services.common.codec import KVHandle
from services.common.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tenant: str = ""
    kv: KVHandle | None = None
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None
    generator_state: bytes = b""
    cached_tokens: int = 0


class DecodeCore:
    """Owns the engine of a decode worker and its KV transport."""

    def __init__(
        self,
        engine: AsyncEngine,
        transport: KVTransport,
        worker_id: str,
        incarnation: str,
        transfer_timeout: float = 30.0,
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.transfer_timeout = transfer_timeout
        self.blocks_pulled = 0

    async def generate(self, job: DecodeJob) -> AsyncIterator[RequestOutput]:
        if job.kv is None:
            async for out in self.engine.generate(
                job.request_id, job.prompt, job.params, tenant=job.tenant or None
            ):
                yield out
            return
        await self._receive_kv(job)
        eng = self.engine.engine

        def add() -> None:
            assert job.first_token is not None
            eng.add_prefilled(
                job.request_id,
                job.prompt,
                job.first_token,
                job.params,
                tenant=job.tenant or None,
                first_logprob=job.first_logprob,
                generator_state=job.generator_state,
                num_cached_tokens=job.cached_tokens,
            )

        async for out in self.engine.follow(job.request_id, add):
            yield out

    async def _receive_kv(self, job: DecodeJob) -> None:
        """Reserve blocks, pull the ones not cached here, tell prefill to release."""
        assert job.kv is not None and job.first_token is not None
        eng = self.engine.engine
        if job.kv.block_bytes != eng.runner.block_bytes:
            raise FailedPrecondition(
                f"KV layout mismatch: prefill blocks are {job.kv.block_bytes} bytes, "
                f"this worker's are {eng.runner.block_bytes}"
            )
        dst, cached = eng.reserve(job.request_id, job.prompt, job.tenant or None)
        skip = cached // eng.config.block_size
        try:
            data = await self.transport.pull(
                job.request_id, job.kv, job.kv.block_ids[skip:], self.transfer_timeout
            )
            eng.write_blocks(dst[skip:], data)
        except KVTransferError as e:
            eng.release(job.request_id)
            raise Unavailable(str(e)) from e
        except BaseException:
            eng.release(job.request_id)
            raise
        self.blocks_pulled += len(dst) - skip
        await self.transport.release(job.request_id, job.kv)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)
