"""Conversions between the ``tandem.v1`` messages and the engine's types, shared by the
router, prefill and decode services (their ``codec.py`` modules build on these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.v1 import common_pb2

from engine.grammar import GrammarSpec
from engine.sampling_params import SamplingParams, TokenLogprob

if TYPE_CHECKING:  # the router uses this module and must not load the engine (torch)
    from engine.llm_engine import RequestOutput

FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}
PRIORITY_TO_PB = {
    "interactive": common_pb2.PRIORITY_INTERACTIVE,
    "batch": common_pb2.PRIORITY_BATCH,
}
PRIORITY_FROM_PB = {v: k for k, v in PRIORITY_TO_PB.items()}
GRAMMAR_TO_PB = {
    "json_schema": common_pb2.GRAMMAR_KIND_JSON_SCHEMA,
    "lark": common_pb2.GRAMMAR_KIND_LARK,
    "regex": common_pb2.GRAMMAR_KIND_REGEX,
}
GRAMMAR_FROM_PB = {v: k for k, v in GRAMMAR_TO_PB.items()}


def priority_from_pb(value: int) -> str:
    """The priority name ("interactive" or "batch"); an unknown (newer) value is interactive."""
    return PRIORITY_FROM_PB.get(value, "interactive")


@dataclass(frozen=True, slots=True)
class KVHandle:
    """Where a prefilled request's KV blocks live (mirror of ``tandem.v1.KVHandle``)."""

    worker_id: str
    incarnation: str
    address: str
    block_ids: tuple[int, ...]
    num_tokens: int
    block_size: int
    block_bytes: int
    dtype: str
    lease_expires_unix_ms: int
    block_checksums: tuple[int, ...] = ()  # per block, from the sender; () = unchecked
    checksum_algorithm: str = ""  # what computed them (engine.kv_checksum); "" = older sender


@dataclass(slots=True)
class Event:
    """One slice of a request's output stream (mirror of ``tandem.v1.TokenEvent``)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # a stop string, a stop token's id, or None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    index: int = 0  # the choice (n > 1)
    moved: Moved | None = None  # a draining decode worker hands the request over
    delivered: bool = False  # the caller streamed it from the worker itself (the Route RPC)


@dataclass(frozen=True, slots=True)
class Moved:
    """A running request's KV held by a draining decode worker (mirror of ``tandem.v1.MovedKV``):
    the prompt and every output token but the last."""

    kv: KVHandle
    generator_state: bytes = b""


@dataclass(frozen=True, slots=True)
class ChoiceStart:
    """A choice's first event from the prefill worker and its generator state (mirror of
    ``tandem.v1.ChoiceStart``)."""

    first: Event
    generator_state: bytes = b""


def sampling_from_pb(opts: common_pb2.SamplingOptions) -> SamplingParams:
    """Validated SamplingParams (raises InvalidSamplingParamsError on bad values)."""
    return SamplingParams(
        max_tokens=opts.max_tokens or 16,
        temperature=opts.temperature if opts.HasField("temperature") else 1.0,
        top_p=opts.top_p if opts.HasField("top_p") else 1.0,
        top_k=opts.top_k,
        min_p=opts.min_p,
        seed=opts.seed if opts.HasField("seed") else None,
        presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty,
        repetition_penalty=(
            opts.repetition_penalty if opts.HasField("repetition_penalty") else 1.0
        ),
        stop=tuple(opts.stop),
        stop_token_ids=tuple(opts.stop_token_ids),
        ignore_eos=opts.ignore_eos,
        logprobs=opts.logprobs if opts.HasField("logprobs") else None,
        n=opts.n or 1,
        logit_bias=tuple(sorted(opts.logit_bias.items())),
        grammar=_grammar_from_pb(opts.grammar) if opts.HasField("grammar") else None,
        min_tokens=opts.min_tokens,
        include_stop_str_in_output=opts.include_stop_str_in_output,
        skip_special_tokens=(
            opts.skip_special_tokens if opts.HasField("skip_special_tokens") else True
        ),
        booked_tokens=opts.booked_tokens,
    )


def _grammar_from_pb(g: common_pb2.Grammar) -> GrammarSpec:
    """The grammar (InvalidGrammarError, an InvalidRequestError, for an unknown kind)."""
    return GrammarSpec(GRAMMAR_FROM_PB.get(g.kind, "unspecified"), g.text)


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingOptions:
    opts = common_pb2.SamplingOptions(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        n=p.n,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        booked_tokens=p.booked_tokens,
    )
    if not p.skip_special_tokens:
        opts.skip_special_tokens = False
    if p.grammar is not None:
        opts.grammar.CopyFrom(
            common_pb2.Grammar(kind=GRAMMAR_TO_PB[p.grammar.kind], text=p.grammar.text)
        )
    if p.seed is not None:
        opts.seed = p.seed
    if p.logprobs is not None:
        opts.logprobs = p.logprobs
    return opts


def logprob_to_pb(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        rank=lp.rank,
    )


def logprob_from_pb(lp: common_pb2.TokenLogprob) -> TokenLogprob:
    top = tuple((t.token_id, t.logprob) for t in lp.top)
    return TokenLogprob(lp.token_id, lp.logprob, top, lp.rank)


def event_from_output(out: RequestOutput) -> Event:
    """The delta of one engine step as an Event; usage filled in when it finished."""
    ev = Event(
        request_id=out.request_id,
        token_ids=list(out.new_token_ids),
        text=out.new_text,
        logprobs=list(out.new_logprobs),
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        index=out.index,
    )
    if out.finished:
        ev.prompt_tokens = len(out.prompt_token_ids)
        ev.completion_tokens = len(out.token_ids)
        ev.cached_tokens = out.num_cached_tokens
    return ev


def event_to_pb(ev: Event) -> common_pb2.TokenEvent:
    msg = common_pb2.TokenEvent(
        request_id=ev.request_id,
        token_ids=ev.token_ids,
        text=ev.text,
        logprobs=[logprob_to_pb(lp) for lp in ev.logprobs],
        finish_reason=FINISH_TO_PB[ev.finish_reason],
        index=ev.index,
    )
    if isinstance(ev.stop_reason, int):
        msg.stop_token_id = ev.stop_reason
    elif ev.stop_reason:
        msg.stop_reason = ev.stop_reason
    if ev.moved is not None:
        msg.moved.kv.CopyFrom(handle_to_pb(ev.moved.kv))
        msg.moved.generator_state = ev.moved.generator_state
    if ev.finish_reason is not None:
        msg.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=ev.prompt_tokens,
                completion_tokens=ev.completion_tokens,
                cached_tokens=ev.cached_tokens,
            )
        )
    return msg


def stop_reason_from_pb(msg: common_pb2.TokenEvent) -> str | int | None:
    """What ended a choice: its stop string, its stop token's id, or None (EOS, a length)."""
    return msg.stop_token_id if msg.HasField("stop_token_id") else msg.stop_reason or None


def event_from_pb(msg: common_pb2.TokenEvent) -> Event:
    return Event(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=[logprob_from_pb(lp) for lp in msg.logprobs],
        finish_reason=FINISH_FROM_PB[msg.finish_reason],
        stop_reason=stop_reason_from_pb(msg),
        prompt_tokens=msg.usage.prompt_tokens,
        completion_tokens=msg.usage.completion_tokens,
        cached_tokens=msg.usage.cached_tokens,
        index=msg.index,
        moved=(
            Moved(handle_from_pb(msg.moved.kv), msg.moved.generator_state)
            if msg.HasField("moved")
            else None
        ),
    )


def handle_to_pb(h: KVHandle) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        worker_id=h.worker_id,
        incarnation=h.incarnation,
        address=h.address,
        block_ids=list(h.block_ids),
        num_tokens=h.num_tokens,
        block_size=h.block_size,
        block_bytes=h.block_bytes,
        dtype=h.dtype,
        lease_expires_unix_ms=h.lease_expires_unix_ms,
        block_checksums=list(h.block_checksums),
        checksum_algorithm=h.checksum_algorithm,
    )


def handle_from_pb(msg: common_pb2.KVHandle) -> KVHandle:
    return KVHandle(
        worker_id=msg.worker_id,
        incarnation=msg.incarnation,
        address=msg.address,
        block_ids=tuple(msg.block_ids),
        num_tokens=msg.num_tokens,
        block_size=msg.block_size,
        block_bytes=msg.block_bytes,
        dtype=msg.dtype,
        lease_expires_unix_ms=msg.lease_expires_unix_ms,
        block_checksums=tuple(msg.block_checksums),
        checksum_algorithm=msg.checksum_algorithm,
    )
