"""Disaggregation support of the engine: a prefill hands its KV off, a decode takes it over.

Prefill side: a request added with ``hold_kv=True`` leaves the batch after its first token but
keeps its block table ("held") until ``release``. Decode side: ``reserve`` allocates a table for
a prompt whose KV will arrive (reusing this worker's own cached prefix), ``write_blocks`` fills
it, and ``add_prefilled`` joins the request to the running batch after its first token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError, KVCapacityError, RequestNotFoundError
from engine.sampler import TokenLogprob
from engine.sampling_params import SamplingParams
from libkv.hashing import encode_extra_keys

if TYPE_CHECKING:
    import threading

    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from libkv.kv_manager import KVCacheManager


class HandoffMixin:
    """Methods of ``LLMEngine`` for moving a request's KV between workers."""

    # Provided by LLMEngine.
    config: EngineConfig
    kv: KVCacheManager
    runner: ModelRunner
    scheduler: Scheduler
    _lock: threading.RLock
    _requests: dict
    _reserved: set[str]
    _held: set[str]
    _held_seqs: dict[str, Sequence]

    if TYPE_CHECKING:

        def _validate(self, ids: list[int], params: SamplingParams) -> None: ...
        def _new_request(self, request_id: str, ids: list[int], params: SamplingParams, tenant): ...
        def _register(self, req) -> None: ...

    def held_block_ids(self, request_id: str) -> list[int]:
        """Blocks a prefill hand-off keeps for the decode worker, in token order."""
        with self._lock:
            if request_id not in self._held:
                raise RequestNotFoundError(f"no held KV for request {request_id!r}")
            return self.kv.block_ids(request_id)

    def release(self, request_id: str) -> bool:
        """Free held (prefill) or reserved (decode) blocks; full ones stay in the prefix cache."""
        with self._lock:
            if request_id in self._held or request_id in self._reserved:
                self._held.discard(request_id)
                self._held_seqs.pop(request_id, None)
                self._reserved.discard(request_id)
                self.kv.free(request_id)
                return True
            return False

    def generator_state(self, request_id: str) -> bytes:
        """Serialized state of a held request's seeded generator (b"" when unseeded)."""
        with self._lock:
            seq = self._held_seqs.get(request_id)
            if seq is None or seq.generator is None:
                return b""
            return bytes(seq.generator.get_state().numpy().tobytes())

    @property
    def num_held(self) -> int:
        return len(self._held)

    def reserve(
        self, request_id: str, prompt: list[int], tenant: str | None = None
    ) -> tuple[list[int], int]:
        """Allocate blocks for a prompt whose KV will arrive from a prefill worker.

        Reuses this worker's own cached prefix: returns (block ids, number of leading tokens
        already cached here); only blocks from ``cached // block_size`` on need filling.
        Raises KVCapacityError when the pool cannot hold it now.
        """
        self._validate(prompt, SamplingParams(max_tokens=1))
        extra = encode_extra_keys(tenant)
        with self._lock:
            if request_id in self._requests or request_id in self.kv:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            hit = self.kv.find_prefix(prompt, extra)
            cached = min(hit.num_tokens(self.config.block_size), len(prompt))
            if self.kv.admit(request_id, hit, len(prompt), len(prompt), extra) is None:
                raise KVCapacityError("no free KV blocks for the incoming request; retry later")
            self._reserved.add(request_id)
            return self.kv.block_ids(request_id), cached

    def add_prefilled(
        self,
        request_id: str,
        prompt: list[int],
        first_token: int,
        params: SamplingParams,
        *,
        tenant: str | None = None,
        first_logprob: TokenLogprob | None = None,
        generator_state: bytes = b"",
        num_cached_tokens: int = 0,
        recompute: bool = False,
        priority: int = 0,
    ) -> None:
        """Join a reserved request, whose prompt KV has been written, to the running batch.

        The first token was sampled (and streamed) by the prefill worker; its text is not
        emitted again here. ``recompute``: the KV never arrived (transfer failed, reservation
        released); the request queues like a preempted one and this engine recomputes prompt
        and first token (reusing its own cached prefix) before sampling the second token.
        """
        self._validate(prompt, params)
        req = self._new_request(request_id, prompt, params, tenant)
        seq = req.seq
        seq.priority = priority
        if generator_state and seq.generator is not None:
            seq.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
        seq.output_token_ids.append(first_token)
        seq.num_computed = 0 if recompute else len(prompt)
        seq.num_cached_prompt_tokens = num_cached_tokens
        if req.logprobs is not None and first_logprob is not None:
            req.logprobs.append(first_logprob)
        req.text = req.detok.push([first_token]).text
        with self._lock:
            if recompute:
                self._register(req)
                self.scheduler.add(seq)
                return
            if request_id not in self._reserved:
                raise RequestNotFoundError(f"no reserved KV for request {request_id!r}")
            self._register(req)
            self._reserved.discard(request_id)
            self.kv.commit(request_id, seq.all_token_ids, seq.num_computed)
            self.scheduler.attach(seq)

    def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None:
        """Copy raw block bytes (pool layout and dtype) into this pool."""
        self.runner.write_blocks(block_ids, data)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Raw bytes of whole blocks (all layers, K and V) in the pool's layout and dtype."""
        return self.runner.read_blocks(block_ids)
