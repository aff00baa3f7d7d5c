"""Disaggregation support of the engine: a prefill hands its KV off, a decode takes it over.

Prefill side: a request added with ``hold_kv=True`` leaves the batch after its first token (one
per choice) but keeps its prompt's block table ("held") until ``release``. Decode side:
``reserve`` allocates a table for a prompt whose KV will arrive (reusing this worker's own cached
prefix), ``write_blocks`` fills it, and ``add_prefilled`` joins the request's choices to the
running batch after their first tokens; with ``n > 1`` they all share the one prompt table
(copy-on-write), so the prompt's KV moves once. A grammar-constrained choice gets a fresh matcher
that replays its first token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.choices import Choice, Request, RequestTables
from engine.errors import InvalidRequestError, KVCapacityError, RequestNotFoundError
from engine.sampling_params import SamplingParams, TokenLogprob
from libkv.hashing import encode_extra_keys
from libkv.host_tier import HostHit

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from engine.step_loop import Stepper
    from engine.structured import GrammarRuntime
    from libkv.kv_manager import KVCacheManager, PrefixHit


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A choice's first token, sampled by the prefill worker, and what goes with it."""

    index: int
    token: int
    logprob: TokenLogprob | None = None
    generator_state: bytes = b""
    # A migrated choice: the tokens it streamed from another worker before ``token``.
    earlier: tuple[int, ...] = ()

    @property
    def tokens(self) -> list[int]:
        """Every output token the choice has, in order."""
        return [*self.earlier, self.token]


@dataclass(frozen=True, slots=True)
class HeldKV:
    """A running request taken out of this engine's batch with its KV kept (a live move off a
    draining decode worker): ``block_ids`` hold the KV of ``num_tokens`` tokens, the prompt
    and every output token but the last, which the worker taking over feeds next."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    output_token_ids: tuple[int, ...]
    generator_state: bytes = b""


def advance(generator: torch.Generator, steps: int, width: int) -> None:
    """Move a seeded generator past ``steps`` sampled tokens: the sampler draws ``width``
    uniforms from it per token (``engine.sampler._race``), so the same draws, in the same
    sizes on the same device, leave it where the worker that sampled them left it."""
    scratch = torch.empty(width, device=generator.device)
    for _ in range(steps):
        scratch.uniform_(generator=generator)


class Handoff:
    """Moving a request's KV between workers, under the engine lock; a part the engine holds.

    ``tables`` are the engine's request tables (``engine.choices.RequestTables``): a reserved
    table joins ``requests`` in ``add_prefilled``, a moved request leaves it for ``held``.
    ``stepper`` is the engine's step loop: the step in flight is waited for before KV arrives
    from off the engine's stream, and a token of a moving sequence still in flight is taken
    back. ``validate`` checks a prompt and its parameters, ``new_choice`` builds a choice
    (``Intake.new_choice``), ``check_lora`` names a loaded adapter."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        runner: ModelRunner,
        scheduler: Scheduler,
        grammar: GrammarRuntime,
        lock: threading.RLock,
        tables: RequestTables,
        stepper: Stepper,
        max_model_len: int,
        validate: Callable[[list[int], SamplingParams], None],
        new_choice: Callable[..., Choice],
        check_lora: Callable[[str | None], str],
    ) -> None:
        self.config, self.kv, self.runner, self.scheduler = config, kv, runner, scheduler
        self.grammar, self._lock, self._tables, self._stepper = grammar, lock, tables, stepper
        self.max_model_len = max_model_len
        self._validate, self._new_choice, self._check_lora = validate, new_choice, check_lora

    @property
    def num_held(self) -> int:
        """Block tables held for a decode worker (prefill side)."""
        return len(self._tables.held)

    def held_block_ids(self, request_id: str) -> list[int]:
        """Blocks a prefill hand-off keeps for the decode worker, in token order."""
        with self._lock:
            if request_id not in self._tables.held:
                raise RequestNotFoundError(f"no held KV for request {request_id!r}")
            return self.kv.block_ids(request_id)

    def release(self, request_id: str) -> bool:
        """Free held (prefill) or reserved (decode) blocks; full ones stay in the prefix cache."""
        with self._lock:
            if request_id in self._tables.held or request_id in self._tables.reserved:
                self._tables.held.discard(request_id)
                self._tables.held_seqs.pop(request_id, None)
                self._tables.reserved.discard(request_id)
                self.kv.free(request_id)
                return True
            return False

    def generator_state(self, request_id: str, index: int = 0) -> bytes:
        """Serialized state of the seeded generator of a held request's choice ``index`` (b""
        when unseeded, or when that choice already finished)."""
        with self._lock:
            seq = self._tables.held_seqs.get(request_id, {}).get(index)
            if seq is None or seq.generator is None:
                return b""
            return bytes(seq.generator.get_state().numpy().tobytes())

    def held_choices(self, request_id: str) -> list[int]:
        """Indices of a held request's choices that go on at the decode worker."""
        with self._lock:
            return sorted(self._tables.held_seqs.get(request_id, {}))

    def reserve(
        self,
        request_id: str,
        prompt: list[int],
        tenant: str | None = None,
        lora: str | None = None,
    ) -> tuple[list[int], int]:
        """Allocate blocks for a prompt whose KV will arrive from a prefill worker.

        Reuses this worker's own cached prefix: returns (block ids, number of leading tokens
        already cached here); only blocks from ``cached // block_size`` on need filling.
        Raises KVCapacityError when the pool cannot hold it now. ``lora``: the request's adapter
        (salts the cache keys as on the prefill side).

        With a step in flight it first waits for the device to run it: the blocks handed out
        may have been freed under that step (``engine.step_loop``), and the KV that arrives is
        written from off the engine's stream. Blocks of the prompt this worker holds in its
        host tier (``libkv.host_tier``) count as cached: they are paged in at once.
        """
        self._validate(prompt, SamplingParams(max_tokens=1))
        with self._lock:
            self._stepper.await_device()
            extra = encode_extra_keys(tenant, self._check_lora(lora) or None)
            if request_id in self._tables.requests or request_id in self.kv:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            hit = self.kv.find_prefix(prompt, extra)
            host = host_part(self.kv, prompt, extra, hit)
            bs = self.config.block_size
            cached = min((len(hit.blocks) + len(host)) * bs, len(prompt))
            if self.kv.admit(request_id, hit, len(prompt), len(prompt), extra) is None:
                raise KVCapacityError("no free KV blocks for the incoming request; retry later")
            self._tables.reserved.add(request_id)
            ids = self.kv.block_ids(request_id)
            if host and self.kv.tier is not None:  # paged in now, ahead of anything after it
                self.kv.tier.page_in(host, ids[len(hit.blocks) : len(hit.blocks) + len(host)])
                self.runner.run_tier(self.kv.tier.take())
            self.runner.settle_host(ids)  # no host-tier page-out still reads them
            return ids, cached

    def add_prefilled(
        self,
        request_id: str,
        prompt: list[int],
        first_token: int | None,
        params: SamplingParams,
        *,
        tenant: str | None = None,
        first_logprob: TokenLogprob | None = None,
        generator_state: bytes = b"",
        num_cached_tokens: int = 0,
        recompute: bool = False,
        priority: int = 0,
        firsts: Seq[FirstToken] = (),
        lora: str | None = None,
    ) -> None:
        """Join a reserved request, whose prompt KV has been written, to the running batch.

        ``firsts`` are the choices that go on, each with the first token the prefill worker
        sampled (and streamed; its text is not emitted again here); without them, choice 0
        goes on from ``first_token``, ``first_logprob`` and ``generator_state``. Every choice
        shares the reserved prompt blocks. ``recompute``: the KV never arrived (transfer failed,
        reservation released); each choice queues like a preempted sequence and this engine
        recomputes prompt and first token (reusing its own cached prefix) before sampling on.
        ``lora``: the request's adapter (must be loaded here too).
        """
        if not firsts:
            assert first_token is not None, "add_prefilled needs first_token or firsts"
            firsts = [FirstToken(0, first_token, first_logprob, generator_state)]
        self._validate(prompt, params)
        with self._lock:
            adapter = self._check_lora(lora)
        salt = encode_extra_keys(tenant, adapter or None)
        choices = [
            self._prefilled_choice(request_id, prompt, params, salt, f, adapter) for f in firsts
        ]
        for c in choices:
            c.seq.priority = priority
            # The reserved KV covers the prompt and every output token but the last (the first
            # token only, unless the request moved here from another decode worker).
            c.seq.num_computed = 0 if recompute else c.seq.num_tokens - 1
            c.seq.num_cached_prompt_tokens = num_cached_tokens
        req = Request(choices[0].seq, {c.seq.index: c for c in choices})
        with self._lock:
            if recompute:
                self._tables.register(req, self.kv)
                for c in choices:
                    self.scheduler.add(c.seq)
                return
            if request_id not in self._tables.reserved:
                raise RequestNotFoundError(f"no reserved KV for request {request_id!r}")
            self._tables.register(req, self.kv)
            self._tables.reserved.discard(request_id)
            self._share_reserved(request_id, [c.seq for c in choices])

    def _prefilled_choice(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        salt: bytes,
        f: FirstToken,
        lora: str = "",
    ) -> Choice:
        """A choice continuing from its output so far (its first token, or every token a
        migrated choice streamed): generator state and grammar replayed, the text of those
        tokens already sent (what a stop string still holds back is sent as it would have
        been)."""
        if not 0 <= f.index < params.n:
            raise InvalidRequestError(f"choice index {f.index} is not in [0, {params.n})")
        tokens = f.tokens
        if len(prompt) + len(tokens) > self.max_model_len or len(tokens) > params.max_tokens:
            raise InvalidRequestError("the output so far leaves no room to continue")
        c = self._new_choice(request_id, prompt, params, salt, f.index, lora)
        seq = c.seq
        if f.generator_state and seq.generator is not None:
            state = torch.frombuffer(bytearray(f.generator_state), dtype=torch.uint8)
            seq.generator.set_state(state)
        elif seq.generator is not None and not params.greedy:
            # A migrated choice: the generator state stayed with the worker that died.
            advance(seq.generator, len(tokens), self.runner.sampler_width)
        if params.grammar is not None:
            seq.matcher = self.grammar.matcher(params.grammar, replay=tokens)
        seq.output_token_ids.extend(tokens)
        if c.logprobs is not None and f.logprob is not None:
            c.logprobs.append(f.logprob)
        c.text = c.detok.push(tokens).text
        return c

    def _share_reserved(self, request_id: str, seqs: list[Sequence]) -> None:
        """Give every choice the reserved prompt table (shared, copy-on-write) and attach it."""
        for seq in seqs:
            if seq.key != request_id:
                self.kv.fork(request_id, seq.key)
        if all(seq.key != request_id for seq in seqs):
            self.kv.free(request_id)
        for seq in seqs:
            self.kv.commit(seq.key, seq.all_token_ids, seq.num_computed)
            self.scheduler.attach(seq)

    def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None:
        """Copy raw block bytes (pool layout and dtype) into this pool."""
        self.runner.write_blocks(block_ids, data)

    def hold_for_move(self, request_id: str) -> HeldKV | None:
        """Take a running single-choice request out of the batch, keeping its blocks held (as
        a prefill does) for another decode worker to pull; None when it cannot move now (not
        here, several choices, or not between two decode steps). Its stream gets no more
        outputs; `release` frees the blocks. A token of it still in flight (async scheduling)
        is taken back unread: it moves at the tokens its stream has."""
        with self._lock:
            req = self._tables.requests.get(request_id)
            if req is None or req.hold_kv or req.unborn or len(req.live) != 1:
                return None
            (choice,) = req.live.values()
            seq = choice.seq
            if seq not in self.scheduler.running or (seq.num_inflight and not seq.output_token_ids):
                return None  # (its first token in flight: not decoding yet)
            if seq.num_inflight:
                self._stepper.unsample(seq)
            if seq.num_computed != seq.num_tokens - 1:
                return None
            self.scheduler.detach(seq)
            del self._tables.requests[request_id]
            self._stepper.settle_if_idle()  # (emits nothing: this was its last live sequence)
            self._tables.held.add(request_id)
            self._tables.held_seqs[request_id] = {}  # no choice goes on here
            state = b""
            if seq.generator is not None:
                state = bytes(seq.generator.get_state().numpy().tobytes())
            return HeldKV(
                request_id, tuple(self.kv.block_ids(seq.key)), seq.num_computed,
                tuple(seq.output_token_ids), state,
            )  # fmt: skip

    def handoff_checksums(self, block_ids: list[int]) -> list[int]:
        """The checksums a hand-off of ``block_ids`` carries (the pool's own function): those
        of sealed blocks as kept when they were sealed, the others (a last, partial block;
        every block where seals are not tracked) computed now."""
        with self._lock:
            self._stepper.seal_pending()
            sealed = [self.kv.pool.blocks[i].sealed for i in block_ids]
            return self.runner.handoff_checksums(block_ids, sealed)

    def block_checksums(self, block_ids: list[int], algorithm: str | None = None) -> list[int]:
        """Checksums of whole blocks (``engine.kv_checksum``) by ``algorithm`` (None: the
        pool's own, ``runner.checksum_algorithm``), on the pool's device."""
        with self._lock:
            return self.runner.block_checksums(block_ids, algorithm)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Raw bytes of whole blocks (all layers, K and V) in the pool's layout and dtype."""
        return self.runner.read_blocks(block_ids)


def host_part(kv: KVCacheManager, prompt: list[int], extra: bytes, hit: PrefixHit) -> HostHit:
    """The host-tier blocks continuing ``hit`` that are worth paging in (none without a tier)."""
    host = kv.find_host(prompt, extra, hit)
    if kv.tier is None or not kv.tier.worth_paging(len(host) * kv.block_size):
        return HostHit()
    return host
