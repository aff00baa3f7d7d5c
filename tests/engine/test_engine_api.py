"""The offline API on the bundled model: sampling options, stops, logprobs, errors, abort."""

from __future__ import annotations

import json

import pytest
import torch

from engine import (
    LLM,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    RequestNotFoundError,
    SamplingParams,
    UnsupportedModelError,
)
from engine.config import ModelConfig


@pytest.fixture(scope="module")
def llm(smol_dir) -> LLM:
    return LLM(smol_dir, max_num_batched_tokens=128, kv_cache_bytes=128 * 1024**2)


def test_bundled_model_is_the_expected_llama(smol_dir):
    cfg = ModelConfig.from_dir(smol_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings
    tok_cfg = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]


def test_generate_accepts_text_and_token_ids(llm):
    text_out, ids_out = llm.generate(
        ["The capital of France is", llm.tokenizer.encode("The capital of France is")],
        SamplingParams(max_tokens=8, temperature=0),
    )
    assert text_out.token_ids == ids_out.token_ids
    assert text_out.text == llm.tokenizer.decode(text_out.token_ids)
    assert "Paris" in text_out.text
    assert text_out.finish_reason == "length" and len(text_out.token_ids) == 8


def test_chat_stops_at_eos(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=64, temperature=0)
    )
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in out.text and "4" in out.text


def test_seed_reproducible_and_varied(llm):
    prompt = "Write a short poem about the sea:"
    p = dict(max_tokens=16, temperature=1.0, top_p=0.95)
    a = llm.generate([prompt], SamplingParams(seed=7, **p))[0]
    # Same seed inside a different batch, at a different row: same tokens.
    b = llm.generate(["Hello", prompt, "Goodbye"], SamplingParams(seed=7, **p))[1]
    c = llm.generate([prompt], SamplingParams(seed=8, **p))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_is_matched_and_excluded(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0)
    full = llm.generate(["1, 2, 3, 4, 5,"], greedy)[0]
    assert " 8" in full.text
    out = llm.generate(
        ["1, 2, 3, 4, 5,"], SamplingParams(max_tokens=24, temperature=0, stop=[" 8"])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 8"
    assert out.text == full.text[: full.text.index(" 8")]


def test_stop_token_ids_and_ignore_eos(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    full = llm.generate(["The quick brown fox"], greedy)[0]
    target = full.token_ids[3]
    out = llm.generate(
        ["The quick brown fox"],
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target]),
    )[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target  # vLLM's: the id
    chat_ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])
    # The model's own end (EOS) is a stop with no stop reason, as in vLLM.
    ended = llm.generate([chat_ids], SamplingParams(max_tokens=40, temperature=0))[0]
    assert ended.finish_reason == "stop" and ended.stop_reason is None
    forced = llm.generate(
        [chat_ids], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    )[0]
    assert len(forced.token_ids) == 40 and forced.finish_reason == "length"


def test_logprobs_are_raw_model_logprobs(llm):
    prompt = llm.tokenizer.encode("The capital of France is")
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=5))[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    ref = torch.log_softmax(llm.engine.score(prompt + out.token_ids[:2]), dim=-1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-3)
        assert [t for t, _ in lp.top] == row.topk(5).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token


def test_streaming_deltas_concatenate_to_the_full_text(llm):
    prompt = "Once upon a time"
    params = SamplingParams(max_tokens=20, temperature=0)
    pieces = list(llm.stream(prompt, params))
    assert len(pieces) == 20 and pieces[-1].finished
    assert "".join(p.new_text for p in pieces) == llm.generate([prompt], params)[0].text
    assert llm.engine.pool.num_used == 0


def test_abort_frees_blocks_at_once(llm):
    eng = llm.engine
    eng.add_request("long", "Tell me a story.", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.pool.num_used > 0
    out = eng.abort("long")
    assert out.finish_reason == "abort"
    assert eng.pool.num_used == 0 and not eng.has_unfinished()
    eng.check_integrity()
    with pytest.raises(RequestNotFoundError):
        eng.abort("long")


def test_clear_errors(llm, tmp_path):
    limit = llm.engine.max_model_len
    with pytest.raises(PromptTooLongError, match=str(limit)):
        llm.generate([[1] * limit])
    with pytest.raises(PromptTooLongError, match="max_tokens"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=limit))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]])
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[10**9]])
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(logprobs=99)):
        with pytest.raises(InvalidSamplingParamsError):
            SamplingParams(**bad)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(tmp_path)
    assert llm.engine.pool.num_used == 0


def test_kv_capacity_error_names_the_pool(smol_dir):
    small = LLM(smol_dir, num_kv_blocks=4)
    with pytest.raises(PromptTooLongError, match="KV blocks"):
        small.generate([[1] * 60], SamplingParams(max_tokens=10))


def test_dummy_weights_from_config_only(smol_dir):
    llm = LLM(smol_dir, load_format="dummy", num_kv_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_a_text_prompt_gets_the_tokenizers_bos(smol_dir, tmp_path) -> None:
    """As vLLM's and transformers': a string prompt is tokenized with the tokenizer's own
    special tokens (a Llama tokenizer's BOS; here a SmolLM2 tokenizer made to add one)."""
    from tests.conftest import BOS_ID, make_bos_model_dir

    llm = LLM(make_bos_model_dir(tmp_path / "bos", smol_dir), num_kv_blocks=64, max_model_len=1024)
    params = SamplingParams(max_tokens=4, temperature=0)
    [text] = llm.generate("The capital of France is", params)
    ids = llm.tokenizer.encode("The capital of France is")
    assert text.prompt_token_ids == [BOS_ID, *ids]
    [by_ids] = llm.generate([BOS_ID, *ids], params)
    assert by_ids.token_ids == text.token_ids


def test_stop_tokens_text_min_tokens_and_special_tokens_follow_vllm(llm) -> None:
    """vLLM's semantics: the text of the token that stopped a sequence (a stop_token_ids token,
    or EOS) is left out unless include_stop_str_in_output; a stop string likewise;
    min_tokens masks EOS and stop tokens until reached; skip_special_tokens=False keeps the
    special tokens' text."""
    tok = llm.tokenizer
    prompt = "The capital of France is"
    base = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0]
    stop_id = base.token_ids[1]  # "."
    stopped = llm.generate(
        prompt, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id])
    )[0]
    assert stopped.token_ids == base.token_ids[:2] and stopped.stop_reason == stop_id
    assert stopped.text == tok.decode(base.token_ids[:1])  # " Paris", without the "."
    kept = llm.generate(
        prompt,
        SamplingParams(
            max_tokens=8, temperature=0, stop_token_ids=[stop_id], include_stop_str_in_output=True
        ),
    )[0]
    assert kept.text == tok.decode(base.token_ids[:2])
    by_string = llm.generate(
        prompt,
        SamplingParams(max_tokens=8, temperature=0, stop=["ari"], include_stop_str_in_output=True),
    )[0]
    assert by_string.text == " Pari" and by_string.stop_reason == "ari"
    # A chat answer that ends with EOS early; with min_tokens it goes on past that point.
    chat = tok.encode_chat([{"role": "user", "content": "Hi"}])
    short = llm.generate(chat, SamplingParams(max_tokens=60, temperature=0))[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == tok.eos_token_id
    n = len(short.token_ids)
    longer = llm.generate(chat, SamplingParams(max_tokens=60, temperature=0, min_tokens=n + 4))[0]
    assert len(longer.token_ids) >= n + 4
    assert tok.eos_token_id not in longer.token_ids[: n + 4]
    assert longer.token_ids[: n - 1] == short.token_ids[:-1]  # the same until the masked EOS
    special = llm.generate(
        chat,
        SamplingParams(
            max_tokens=60, temperature=0, skip_special_tokens=False, include_stop_str_in_output=True
        ),
    )[0]
    assert special.text == short.text + "<|im_end|>"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
