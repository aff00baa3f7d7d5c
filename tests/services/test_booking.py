"""What admission books for a request that leaves ``max_tokens`` out: the gateway's
``--default-booked-tokens`` (``SamplingParams.booked_tokens``, carried in ``SamplingOptions``),
booked alike by the gateway, the router's copy of a decode worker's ledger and the decode worker
(`services.common.admission.request_cost`), while the request may still run to its cap."""

from __future__ import annotations

import dataclasses

import pytest
from tandem.v1 import common_pb2

from engine.bundled import DEFAULT_DIR
from engine.errors import InvalidSamplingParamsError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from services.common.admission import (
    BOUND_KEY,
    TokenLedger,
    booked_completion,
    bound_record,
    request_cost,
    resumed_cost,
)
from services.common.codec import sampling_from_pb, sampling_to_pb
from services.common.errors import ResourceExhausted
from services.decode.core import DecodeCore, DecodeJob
from services.gateway.config import GatewayConfig, parse_config
from services.gateway.core import APIError, BackendRequest
from services.gateway.keys import TenantLimits
from services.gateway.limits import Limits, cost_of
from services.gateway.prepare import prepare_chat, prepare_completion
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.router.admission import DecodeAdmission
from services.router.calls import RouteJob
from tests.services.test_router_core import member

MODEL = "smol"
CAP, BOOKED = 100, 30  # the gateway's --default-max-tokens and --default-booked-tokens here
CONFIG = GatewayConfig(
    model_dir=str(DEFAULT_DIR), served_model_name=MODEL, max_model_len=512,
    default_max_tokens=CAP, default_booked_tokens=BOOKED,
)  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEFAULT_DIR)


def completion(cfg: GatewayConfig, tok: Tokenizer, prompt_len: int = 10, **body) -> SamplingParams:
    """The sampling params the gateway prepares for a completion of ``prompt_len`` token ids."""
    req = CompletionRequest(model=MODEL, prompt=list(range(20, 20 + prompt_len)), **body)
    return prepare_completion(cfg, tok, req, "cmpl-1", "t").backend_request.sampling


# -- SamplingParams -------------------------------------------------------------------------------
def test_booked_tokens_defaults_to_none_and_is_checked_against_max_tokens() -> None:
    assert SamplingParams(max_tokens=5).booked_tokens == 0  # 0: max_tokens is booked
    assert SamplingParams(max_tokens=5, booked_tokens=5).booked_tokens == 5
    for bad in (-1, 6, True, 2.0):
        with pytest.raises(InvalidSamplingParamsError, match=r"^booked_tokens: "):
            SamplingParams(max_tokens=5, booked_tokens=bad)  # type: ignore[arg-type]


# -- the one helper -------------------------------------------------------------------------------
def test_request_cost_books_each_choice_its_booking_else_its_max_tokens() -> None:
    assert request_cost(10, SamplingParams(max_tokens=100)) == 110
    assert request_cost(10, SamplingParams(max_tokens=100, booked_tokens=8)) == 18
    assert request_cost(10, SamplingParams(max_tokens=100, booked_tokens=8, n=3)) == 34
    assert booked_completion(SamplingParams(max_tokens=100, n=3)) == 300


def test_a_migrated_request_books_what_it_produced_and_a_booking_for_the_rest() -> None:
    """On the decode worker it moves to after ``done`` tokens: never below `request_cost`, nor
    below its prompt, those tokens (held in KV there at once) and a new request's booking for
    the rest, at most what max_tokens leaves."""
    part = SamplingParams(max_tokens=100, booked_tokens=8)
    assert resumed_cost(10, 0, part) == request_cost(10, part) == 18
    assert resumed_cost(10, 5, part) == 10 + 5 + 8
    assert resumed_cost(10, 60, part) == 10 + 60 + 8  # far past its booking of 8
    assert resumed_cost(10, 95, part) == resumed_cost(10, 100, part) == 110  # 5, 0 left to come
    whole = SamplingParams(max_tokens=100)
    assert {resumed_cost(10, done, whole) for done in (0, 1, 60, 100)} == {110}  # as before
    assert DecodeJob("r", list(range(10)), part, resumed=list(range(60))).cost == 78


def test_every_booker_books_the_same() -> None:
    """Gateway ledger, router (ledger copy and route estimate) and decode worker agree."""
    params = SamplingParams(max_tokens=100, booked_tokens=8, n=2)
    prompt = list(range(10))
    assert cost_of(BackendRequest("r", tuple(prompt), params, "t", MODEL)) == 26
    job = RouteJob("r", prompt, params)
    assert job.cost == 26 and job.route.max_tokens == 16  # completion tokens as booked
    assert DecodeJob("r", prompt, params).cost == 26


# -- codec ----------------------------------------------------------------------------------------
def test_booked_tokens_cross_the_wire_both_ways() -> None:
    params = SamplingParams(max_tokens=100, booked_tokens=8, n=2)
    msg = sampling_to_pb(params)
    assert msg.booked_tokens == 8
    assert sampling_from_pb(common_pb2.SamplingOptions.FromString(msg.SerializeToString())) == (
        params
    )
    # An older sender sets none: the whole max_tokens is booked, as before.
    assert sampling_from_pb(common_pb2.SamplingOptions(max_tokens=40)).booked_tokens == 0
    with pytest.raises(InvalidSamplingParamsError, match="booked_tokens"):
        sampling_from_pb(common_pb2.SamplingOptions(max_tokens=40, booked_tokens=41))


# -- the gateway's prepare and option -------------------------------------------------------------
def test_an_omitted_max_tokens_runs_to_the_cap_but_books_at_most_the_option(tok) -> None:
    sp = completion(CONFIG, tok)
    assert (sp.max_tokens, sp.booked_tokens) == (CAP, BOOKED)
    assert request_cost(10, sp) == 10 + BOOKED
    sp = completion(CONFIG, tok, n=2)
    assert request_cost(10, sp) == 10 + 2 * BOOKED
    # The cap is the context left when that is smaller; the booking never exceeds the cap.
    sp = completion(CONFIG, tok, prompt_len=490)
    assert (sp.max_tokens, sp.booked_tokens) == (22, 22)
    big = dataclasses.replace(CONFIG, default_booked_tokens=10 * CAP)
    assert completion(big, tok).booked_tokens == CAP
    # Chat alike (templated prompt).
    chat = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    )
    sp = prepare_chat(CONFIG, tok, chat, "c", "t").backend_request.sampling
    assert (sp.max_tokens, sp.booked_tokens) == (CAP, BOOKED)


def test_an_explicit_max_tokens_is_booked_whole(tok) -> None:
    sp = completion(CONFIG, tok, max_tokens=50)
    assert (sp.max_tokens, sp.booked_tokens) == (50, 0) and request_cost(10, sp) == 60
    chat = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
         "max_completion_tokens": 7}
    )  # fmt: skip
    sp = prepare_chat(CONFIG, tok, chat, "c", "t").backend_request.sampling
    assert (sp.max_tokens, sp.booked_tokens) == (7, 0)


def test_option_zero_books_the_whole_cap_as_before(tok) -> None:
    sp = completion(dataclasses.replace(CONFIG, default_booked_tokens=0), tok)
    assert (sp.max_tokens, sp.booked_tokens) == (CAP, 0) and request_cost(10, sp) == 10 + CAP


def test_the_option_has_a_flag_a_variable_and_a_floor() -> None:
    base = ["--model-dir", str(DEFAULT_DIR), "--router", "127.0.0.1:1"]
    assert parse_config(base, env={}).default_booked_tokens == 1024
    assert parse_config([*base, "--default-booked-tokens", "7"], env={}).default_booked_tokens == 7
    env = {"TANDEM_DEFAULT_BOOKED_TOKENS": "0"}
    assert parse_config(base, env=env).default_booked_tokens == 0
    with pytest.raises(ValueError, match="default-booked-tokens"):
        dataclasses.replace(CONFIG, default_booked_tokens=-1)


# -- admission at each hop ------------------------------------------------------------------------
BOUND = 100  # tokens; requests of a 10-token prompt with a cap of 48: 58 booked whole, 18 as 8
WHOLE = SamplingParams(max_tokens=48)  # max_tokens given: booked whole
PART = SamplingParams(max_tokens=48, booked_tokens=8)  # left out: 8 booked, may run to 48


def test_the_gateway_admits_by_the_booking_and_meters_what_was_used() -> None:
    lim = Limits(
        {"acme": TenantLimits(tokens_per_window=1000, window_seconds=3600)}, BOUND,
        clock=lambda: 0.0,
    )  # fmt: skip
    tickets = [
        lim.admit(BackendRequest(f"b{i}", tuple(range(10)), PART, "acme", MODEL)) for i in range(5)
    ]
    assert lim.ledger.pending_tokens == 5 * 18
    bucket = tickets[0].buckets[0]
    assert bucket.level == 1000 - 5 * 18  # reserved as booked
    tickets[0].settle(completion_tokens=48)  # ran past its booking: charged what it used
    assert bucket.level == 1000 - 4 * 18 - 58 and lim.ledger.pending_tokens == 4 * 18
    for t in tickets[1:]:
        t.settle(completion_tokens=48)
    lim.admit(BackendRequest("u0", tuple(range(10)), WHOLE, "acme", MODEL))
    with pytest.raises(APIError) as e:  # booked whole, a second one does not fit
        lim.admit(BackendRequest("u1", tuple(range(10)), WHOLE, "acme", MODEL))
    assert e.value.status == 429


def test_the_router_books_its_copy_of_a_decode_ledger_by_the_booking() -> None:
    worker = dataclasses.replace(
        member("d0", "decode"), extra={BOUND_KEY: bound_record(TokenLedger(BOUND))}
    )
    adm = DecodeAdmission(refusal_memory=0.0)
    for i in range(5):
        adm.book(worker, RouteJob(f"b{i}", list(range(10)), PART))
    adm.book(worker, RouteJob("started", list(range(10)), WHOLE), force=True)
    with pytest.raises(ResourceExhausted):  # full: a new request is refused, not a started one
        adm.book(worker, RouteJob("u", list(range(10)), WHOLE))
    for i in range(5):
        adm.released(worker, RouteJob(f"b{i}", list(range(10)), PART))
    adm.released(worker, RouteJob("started", list(range(10)), WHOLE))
    adm.book(worker, RouteJob("u0", list(range(10)), WHOLE))
    with pytest.raises(ResourceExhausted):
        adm.book(worker, RouteJob("u1", list(range(10)), WHOLE))


class _Engine:
    """The slice of EngineClient a decode-only DecodeCore uses: every token to max_tokens; a
    migrated request (`follow_prefilled`): the tokens it has left."""

    async def generate(self, request_id, prompt, params, **kw):
        for i in range(params.max_tokens):
            yield (request_id, i)

    async def follow_prefilled(self, request_id, prompt, params, firsts, **kw):
        for i in range(params.max_tokens - len(firsts[0].tokens)):
            yield (request_id, i)


async def test_the_decode_worker_books_once_and_lets_a_request_run_past_its_booking() -> None:
    core = DecodeCore(_Engine(), None, "d0", "inc", ledger=TokenLedger(BOUND))  # type: ignore[arg-type]
    streams = [core.generate(DecodeJob(f"b{i}", list(range(10)), PART)) for i in range(5)]
    firsts = [await s.__anext__() for s in streams]  # all five admitted: 5 * 18 <= 100
    assert [f[1] for f in firsts] == [0] * 5 and core.ledger.pending_tokens == 90
    with pytest.raises(ResourceExhausted):  # booked whole, a new one does not fit beside them
        await core.generate(DecodeJob("u", list(range(10)), WHOLE)).__anext__()
    rest = [[o async for o in s] for s in streams]  # each runs to 48, far past its 8
    assert all(len(r) == 47 for r in rest)
    assert core.ledger.pending_tokens == 0 and not core.ledger.inflight


async def test_a_migrated_request_is_booked_for_the_tokens_it_brings() -> None:
    """Moved here after 30 tokens (far past its booking of 8): forced past the bound, booked
    at 10 + 30 + 8, not at the 18 a new request books; all of it returned when it ends."""
    core = DecodeCore(_Engine(), None, "d1", "inc", ledger=TokenLedger(BOUND))  # type: ignore[arg-type]
    core.ledger.admit("other", 60)
    job = DecodeJob("m", list(range(10)), PART, admitted=True, resumed=list(range(30)))
    stream = core.generate(job)
    await stream.__anext__()
    assert core.ledger.inflight["m"] == 48 and core.ledger.pending_tokens == 108
    assert len([o async for o in stream]) == 48 - 30 - 1  # it runs on to its max_tokens
    assert core.ledger.inflight == {"other": 60} and core.resumed == 1


async def test_the_router_books_a_moved_stream_on_its_new_worker_as_that_worker_does() -> None:
    """A stream moved after 30 tokens (booking 8) is counted in the router's copy of its new
    worker's ledger at `resumed_cost` (10 + 30 + 8), what that worker's own ledger books
    (`DecodeJob.cost`), not at the 18 of a new request; and freed when it ends."""
    from services.common.codec import Event
    from services.common.errors import Unavailable
    from services.router.calls import DecodeCall
    from services.router.core import RouterCore
    from tests.services.test_router_core import Clients, Directory

    params = SamplingParams(max_tokens=40, booked_tokens=8)
    prompt = list(range(10))
    moved = DecodeCall(RouteJob("m", prompt, params), admitted=True, resumed=list(range(30)))
    assert moved.cost == DecodeJob("m", prompt, params, resumed=list(range(30))).cost == 48
    assert DecodeCall(RouteJob("n", prompt, params)).cost == 18

    def bounded(worker_id: str):
        return dataclasses.replace(member(worker_id, "decode"),
                                   extra={BOUND_KEY: bound_record(TokenLedger(1000))})  # fmt: skip

    d0, d1 = bounded("d0"), bounded("d1")
    booked: dict[str, int] = {}

    class DiesAfter30(Clients):
        async def decode(self, worker, call):
            ledger = core.admission._ledger(worker)
            booked[worker.worker_id] = ledger.inflight[call.job.request_id]
            for i in range(len(call.resumed), 40):
                if worker.worker_id == "d0" and i == 30:
                    raise Unavailable("d0 died mid-stream")
                yield Event(call.job.request_id, [i], "t",
                            finish_reason="length" if i == 39 else None)  # fmt: skip

    core = RouterCore(Directory([d0, d1]), DiesAfter30())
    events = [ev async for ev in core.generate(RouteJob("m", prompt, params))]
    assert len(events) == 40 and core.stats.migrations == 1
    assert booked == {"d0": 18, "d1": 48}
    assert not core.admission._ledger(d1).inflight  # given back when it ended
