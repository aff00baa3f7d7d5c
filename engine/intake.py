"""Requests entering the engine: the checks every prompt passes, the choices built around its
sequences, and the queueing of a new request (``LLMEngine.add_request``)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from engine.choices import Choice, Request
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from libkv.hashing import encode_extra_keys

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

    from engine.choices import RequestTables
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.structured import GrammarRuntime
    from engine.tokenizer import Tokenizer
    from libkv.kv_manager import KVCacheManager


class Intake:
    """Validates and queues new requests, under the engine lock; a part the engine holds.

    ``validate`` is the one check of a prompt and its parameters (a request's, a decode
    worker's reservation, a pass over one prompt alone), against ``vocab_size``,
    ``max_model_len`` and the pool's size. ``new_choice`` and ``choice_of`` build a choice
    (seeded generator, stop ids, detokenizer) for the engine's other parts; ``counter``
    numbers the engine's sequences (shared with ``engine.pooling``, so ids never repeat).
    ``tables`` are the engine's request tables, ``check_lora`` names a loaded adapter."""

    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        max_model_len: int,
        tokenizer: Tokenizer,
        runner: ModelRunner,
        kv: KVCacheManager,
        scheduler: Scheduler,
        grammar: GrammarRuntime,
        lock: threading.RLock,
        tables: RequestTables,
        eos_token_ids: frozenset[int],
        check_lora: Callable[[str | None], str],
    ) -> None:
        self.config, self.vocab_size, self.max_model_len = config, vocab_size, max_model_len
        self.tokenizer, self.runner, self.kv, self.scheduler = tokenizer, runner, kv, scheduler
        self.grammar, self._lock, self._tables = grammar, lock, tables
        self.eos_token_ids, self._check_lora = eos_token_ids, check_lora
        self.counter = itertools.count()

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        tenant: str | None = None,
        hold_kv: bool = False,
        priority: int = 0,
        lora: str | None = None,
    ) -> None:
        """Validate and queue a request (``LLMEngine.add_request`` says what each argument
        does); its id must not be in use."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        with self._lock:
            adapter = self._check_lora(lora)
        salt = encode_extra_keys(tenant, adapter or None)
        first = self.new_choice(request_id, ids, params, salt, 0, adapter)
        if params.grammar is not None:
            first.seq.matcher = self.grammar.matcher(params.grammar)
        first.seq.priority = priority
        req = Request(first.seq, {0: first}, list(range(1, params.n)), hold_kv)
        with self._lock:
            self._tables.register(req, self.kv)
            self.scheduler.add(first.seq)

    def new_choice(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        salt: bytes,
        index: int,
        lora: str = "",
    ) -> Choice:
        """Choice ``index`` of a request over prompt ``ids``, with a new sequence."""
        seq = Sequence(request_id, ids, params, next(self.counter), salt, index=index, lora=lora)
        return self.choice_of(seq)

    def choice_of(self, seq: Sequence) -> Choice:
        """A Choice around ``seq``, with its seeded generator (seed + index) and detokenizer."""
        params = seq.params
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(
                (params.seed + seq.index) % 2**64
            )
        if params.min_tokens:
            eos = () if params.ignore_eos else self.eos_token_ids
            seq.stop_ids = tuple(sorted({*params.stop_token_ids, *eos}))
        detok = IncrementalDetokenizer(
            self.tokenizer.hf,
            seq.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        return Choice(seq, detok, [] if params.logprobs is not None else None)

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError or PromptTooLongError unless ``ids`` and ``params`` can
        be served here: token ids in the vocabulary, prompt plus ``max_tokens`` within the
        context limit and within the whole KV pool."""
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias: token ids must be in [0, {vocab})")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the context limit is {limit} tokens "
                "(prompt plus at least one generated token)"
            )
        if len(ids) + params.max_tokens > limit:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} exceeds the context limit of {limit} tokens"
            )
        need = self.kv.blocks_for(len(ids) + params.max_tokens)
        pool = self.kv.pool
        if need > pool.num_blocks:
            raise PromptTooLongError(
                f"prompt + max_tokens need {need} KV blocks but the cache holds "
                f"{pool.num_blocks} ({pool.num_blocks * self.config.block_size} tokens)"
            )
