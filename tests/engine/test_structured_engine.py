"""The engine with grammars, n > 1 and logit bias, on the bundled model: constrained samples
validate, choices share the prompt's blocks (fork, then copy-on-write), seeds reproduce, and
grammar state survives preemption, chunked prefill and the prefill -> decode hand-off."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.grammar import GrammarSpec, check_grammar
from engine.handoff import FirstToken

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
# At most ~110 characters of JSON, so max_tokens=200 always lets a sample finish.
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and hobbies."}]


def make_engine(smol_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=64 * 1024**2, **kw))


@pytest.fixture(scope="module")
def engine(smol_dir) -> LLMEngine:
    return make_engine(smol_dir)


def finals(engine: LLMEngine) -> dict[tuple[str, int], object]:
    """Run until idle; the last output of every choice, by (request id, index)."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[(out.request_id, out.index)] = out
    engine.check_integrity()
    assert engine.pool.num_used == 0
    return done


def person(**kw) -> SamplingParams:
    defaults = dict(max_tokens=200, temperature=1.0, grammar=GrammarSpec.json_schema(PERSON))
    return SamplingParams(**{**defaults, **kw})


def test_twenty_json_schema_samples_at_temperature_one_all_validate(engine):
    prompt = engine.tokenizer.encode_chat(ASK)
    for i in range(5):
        engine.add_request(f"json-{i}", prompt, person(n=4, seed=100 * i))
    outs = finals(engine)
    assert sorted(outs) == [(f"json-{i}", j) for i in range(5) for j in range(4)]
    for out in outs.values():
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({o.text for o in outs.values()}) > 10  # sampled, not one answer repeated


def test_choices_share_the_prompt_blocks_then_copy_on_write(engine):
    prompt = engine.tokenizer.encode("Once upon a time, " * 20)[:40]  # 2 full blocks + 8 tokens
    assert len(prompt) == 40
    engine.add_request("fork", prompt, SamplingParams(n=4, max_tokens=8, temperature=1.0))
    first = engine.step()  # the prompt, once; then four first tokens from its logits
    assert sorted(o.index for o in first) == [0, 1, 2, 3]
    assert engine.pool.num_used == 3  # the prompt's three blocks, shared by all four
    engine.step()  # each choice writes into the partial block: three copies, the last in place
    assert engine.pool.num_used == 6
    engine.check_integrity()
    assert len(finals(engine)) == 4  # the rest runs to completion, nothing leaks


def test_seeded_choices_differ_and_reproduce(engine):
    prompt = engine.tokenizer.encode("My favourite colour is")

    def run(rid: str) -> list[list[int]]:
        engine.add_request(rid, prompt, SamplingParams(n=3, max_tokens=12, seed=11))
        outs = finals(engine)
        return [outs[(rid, i)].token_ids for i in range(3)]

    a, b = run("seed-a"), run("seed-b")
    assert a == b and len({tuple(t) for t in a}) == 3
    # Choice i draws from seed + i: choice 1 of seed 11 is choice 0 of seed 12.
    engine.add_request("seed-12", prompt, SamplingParams(max_tokens=12, seed=12))
    assert finals(engine)[("seed-12", 0)].token_ids == a[1]


def test_logit_bias_forces_a_token(engine):
    prompt = engine.tokenizer.encode("The capital of France is")
    target = engine.tokenizer.encode(" Rome")[0]
    params = SamplingParams(max_tokens=3, temperature=0, logit_bias={target: 100.0})
    engine.add_request("bias", prompt, params)
    assert finals(engine)[("bias", 0)].token_ids == [target] * 3


def test_grammar_survives_preemption_and_chunked_prefill(smol_dir, engine):
    long_ask = [{"role": "user", "content": "Here is some context. " * 30 + ASK[0]["content"]}]
    prompt = engine.tokenizer.encode_chat(long_ask)
    params = person(temperature=0, max_tokens=80)
    engine.add_request("ref", prompt, params)
    ref = finals(engine)[("ref", 0)].token_ids
    # 12 blocks of 16 tokens for four sequences of ~230 tokens: preemption is certain; a
    # 64-token budget splits every prompt into chunks.
    tight = make_engine(smol_dir, num_kv_blocks=20, max_num_batched_tokens=64, max_num_seqs=4)
    for i in range(4):
        tight.add_request(f"t{i}", prompt, params)
    outs = finals(tight)
    assert tight.scheduler.num_preemptions > 0
    assert all(outs[(f"t{i}", 0)].token_ids == ref for i in range(4))
    jsonschema.validate(json.loads(outs[("t0", 0)].text), PERSON)


def test_handoff_replays_the_grammar_and_shares_the_prompt(smol_dir, engine):
    prefill, decode = engine, make_engine(smol_dir)
    prompt = engine.tokenizer.encode_chat(ASK)
    params = person(n=3, seed=5)
    offline = make_engine(smol_dir)
    offline.add_request("o", prompt, params)
    ref = {i: out.token_ids for (_, i), out in finals(offline).items()}

    prefill.add_request("h", prompt, params, hold_kv=True)
    firsts = [o for o in prefill.step() if o.request_id == "h"]
    assert sorted(o.index for o in firsts) == [0, 1, 2] and all(o.kv_held for o in firsts)
    assert prefill.handoff.held_choices("h") == [0, 1, 2]
    reserved, _ = decode.handoff.reserve("h", prompt)
    decode.handoff.write_blocks(
        reserved, prefill.handoff.read_blocks(prefill.handoff.held_block_ids("h"))
    )
    starts = [
        FirstToken(o.index, o.token_ids[0], None, prefill.handoff.generator_state("h", o.index))
        for o in firsts
    ]
    assert all(f.generator_state for f in starts)
    prefill.handoff.release("h")
    decode.handoff.add_prefilled("h", prompt, None, params, firsts=starts)
    assert decode.pool.num_used == len(reserved)  # one copy of the prompt for three choices
    outs = finals(decode)
    assert {i: outs[("h", i)].token_ids for i in range(3)} == ref
    for out in outs.values():
        jsonschema.validate(json.loads(out.text), PERSON)


def test_abort_mid_grammar_frees_every_block(engine):
    engine.add_request("gone", engine.tokenizer.encode_chat(ASK), person(n=2, max_tokens=200))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used > 0
    engine.abort("gone")
    engine.check_integrity()
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json_schema", '{"type": "foo"}'),
        GrammarSpec("json_schema", '{"not": {"type": "string"}}'),
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("lark", "start: missing_rule"),
    ],
)
def test_bad_grammars_are_refused(engine, spec):
    with pytest.raises(InvalidRequestError):
        check_grammar(spec)
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [1, 2, 3], SamplingParams(grammar=spec))
    assert not engine.has_unfinished()
