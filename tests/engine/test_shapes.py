"""engine.shapes: a shape folder's tokenizer has exactly the config's vocab_size ids, the ids
above the bundled tokenizer's decode to text, the bundled ids encode as before, and the engine
serves such a folder with dummy weights, streaming text for every sampled id."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer

from bench.words import WORDS
from engine.shapes import SHAPES, pad_vocab, tokenizer_size, write_shape
from engine.tokenizer import Tokenizer

BUNDLED = 49152
LLAMA = SHAPES["llama-3.1-8b"]["vocab_size"]  # 128,256
SAMPLES = (
    "The quick brown fox jumps over the lazy dog. " * 3,
    " ".join(random.Random(0).choice(WORDS) for _ in range(400)),
    "def f(x):\n    return {'a': x ** 2}  # comment\n\tindent\r\n",
    "Ünïcødé, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, العربية, 12345 67.89",
    "   leading and trailing spaces   ",
    "<|im_start|>user\nhello<|im_end|> <|endoftext|> <repo_name>",
    "sun day the in of and",  # the words the padded tokens join
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smol_dir):
    return write_shape("llama-3.1-8b", tmp_path_factory.mktemp("shape") / "llama", smol_dir)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b", "smollm2-135m"])  # 3 sizes
def test_the_tokenizer_has_the_configs_vocab_size(name, tmp_path, smol_dir):
    out = write_shape(name, tmp_path / name, smol_dir)
    config = json.loads((out / "config.json").read_text())
    spec = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    assert tokenizer_size(spec) == config["vocab_size"] == SHAPES[name]["vocab_size"]
    assert Tokenizer(out).vocab_size == config["vocab_size"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # the tokenizer's own


def test_upper_ids_decode_to_text(llama_dir):
    tok = HFTokenizer.from_file(str(llama_dir / "tokenizer.json"))
    upper = range(BUNDLED, LLAMA)
    texts = tok.decode_batch([[i] for i in upper])
    assert all(t.strip() for t in texts)  # every one: words, never nothing
    assert len(set(texts)) == len(upper)
    ids = random.Random(1).sample(upper, 64)
    assert tok.decode(ids) == "".join(tok.decode([i]) for i in ids)  # " sun day" joins cleanly


def test_bundled_ids_encode_and_decode_as_before(llama_dir, smol_dir):
    old = HFTokenizer.from_file(str(smol_dir / "tokenizer.json"))
    new = HFTokenizer.from_file(str(llama_dir / "tokenizer.json"))
    for text in SAMPLES:
        ids = new.encode(text).ids
        assert ids == old.encode(text).ids and max(ids) < BUNDLED
        assert new.decode(ids) == old.decode(ids)
    ids = [[i] for i in range(BUNDLED)]
    assert new.decode_batch(ids, skip_special_tokens=False) == old.decode_batch(
        ids, skip_special_tokens=False
    )
    chat = [{"role": "user", "content": SAMPLES[1]}]
    assert Tokenizer(llama_dir).encode_chat(chat) == Tokenizer(smol_dir).encode_chat(chat)


def test_padding_only_fills_up():
    spec = {"model": {"type": "BPE", "vocab": {"a": 0, "Ġsun": 1, "Ġday": 2}, "merges": []}}
    assert pad_vocab(spec, 3) is spec
    padded = pad_vocab(spec, 5)["model"]["vocab"]
    assert padded == {**spec["model"]["vocab"], "ĠsunĠday": 3, "ĠdayĠsun": 4}
    assert len(spec["model"]["vocab"]) == 3  # the argument is left alone
    with pytest.raises(ValueError, match="too few"):
        pad_vocab(spec, 6)
    with pytest.raises(ValueError, match="more than vocab_size"):
        pad_vocab(spec, 2)


def test_the_engine_serves_a_padded_folder(tmp_path, smol_dir, monkeypatch):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    tiny = {**SHAPES["llama-3.1-8b"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16}  # fmt: skip
    monkeypatch.setitem(SHAPES, "llama-tiny", tiny)
    out = write_shape("llama-tiny", tmp_path / "tiny", smol_dir)
    llm = LLM(out, load_format="dummy", num_kv_blocks=64, max_model_len=512)
    assert llm.engine.model_config.vocab_size == LLAMA
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=0, ignore_eos=True)
    outs = llm.generate(["Hello there", "The capital of France is"], params)
    ids = [i for o in outs for i in o.token_ids]
    assert len(ids) == 48 and sum(i >= BUNDLED for i in ids) >= 10  # ~62% of a uniform draw
    tok = llm.tokenizer
    assert all(tok.decode([i]) for i in ids)  # every sampled id is text
    for o in outs:
        assert o.text == tok.decode(o.token_ids) and len(o.text) >= 24
