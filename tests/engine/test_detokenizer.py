"""IncrementalDetokenizer against the bundled SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import tokenizers

from engine.bundled import DEFAULT_DIR
from engine.detokenizer import PROMPT_SEED_TOKENS, DetokenizerDelta, IncrementalDetokenizer

# Token ids in the SmolLM2 vocabulary, with what they decode to.
HELLO = 19556  # "Hello"
SP_WORLD = 905  # " world"
SP_WOR = 458  # " wor"
LD = 400  # "ld"
RY = 541  # "ry"
HI = 26843  # "Hi"
SP_EMOJI_HEAD = 40303  # " " + first three bytes of U+1F600
EMOJI_TAIL = 218  # last byte of U+1F600
SP_THERE = 665  # " there"
SP_CJK_HEAD = 17097  # " " + first byte of U+65E5
SP_AGAIN = 1163  # " again"
IM_END = 2  # "<|im_end|>", special
NUM_SPECIAL = 17  # ids 0..16 are special added tokens

MULTILINGUAL = (
    "Café naïve — 日本語のテキスト 😀👍🏽 한국어 Ünïcödé ∑∫ 🇯🇵 👩‍👩‍👧 Ελληνικά Привет مرحبا"
)
REAL_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 3:45 p.m.; don't panic!\n\n  Indented.",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tprint(f'{f(3)=}')\n",
    MULTILINGUAL,
    "🙂🙃😉😊😇🥰😍🤩😘😗☺😚😙🥲😋😛😜🤪😝🤑🤗🤭🤫🤔🤐🤨😐😑😶",
    "中文文本，包含标点符号。日本語もあります！한국어도 있어요?",
)


@pytest.fixture(scope="module")
def tokenizer() -> tokenizers.Tokenizer:
    """The bundled model's tokenizer (``make install`` writes it)."""
    return tokenizers.Tokenizer.from_file(str(DEFAULT_DIR / "tokenizer.json"))


def make_detok(
    tokenizer: tokenizers.Tokenizer,
    prompt: Sequence[int] = (),
    *,
    stop: Sequence[str] = (),
    skip_special_tokens: bool = True,
    **kw,
) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(
        tokenizer, prompt, skip_special_tokens=skip_special_tokens, stop=stop, **kw
    )


def push_each(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[DetokenizerDelta]:
    """Push ``ids`` one at a time; return every delta."""
    return [detok.push([i]) for i in ids]


def random_ids(rng: random.Random, pool: list[int], vocab_size: int, n: int) -> list[int]:
    """Ids mixing runs of real multi-byte text (split mid-character), any token and specials."""
    ids: list[int] = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.4:
            start = rng.randrange(len(pool))
            ids.extend(pool[start : start + rng.randint(1, 6)])
        elif kind < 0.9:
            ids.append(rng.randrange(vocab_size))
        else:
            ids.append(rng.randrange(NUM_SPECIAL))
    return ids[:n]


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 5)
        chunks.append(ids[i : i + size])
        i += size
    return chunks


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-by-one", "random-chunks"])
def test_random_sequences_match_full_decode(
    tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool, chunked: bool
) -> None:
    pool = tokenizer.encode(MULTILINGUAL).ids
    vocab_size = tokenizer.get_vocab_size()
    for seed in range(200):
        rng = random.Random(seed)
        prompt = random_ids(rng, pool, vocab_size, rng.randint(0, 8))
        output = random_ids(rng, pool, vocab_size, rng.randint(1, 40))
        detok = make_detok(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        chunks = random_chunks(rng, output) if chunked else [[i] for i in output]
        pieces = [detok.push(chunk).text for chunk in chunks] + [detok.flush()]
        want = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == want, f"seed {seed}: prompt {prompt} output {output}"
        assert detok.text == want
        assert detok.output_token_ids == output
        assert detok.stop_matched is None


@pytest.mark.parametrize("text", REAL_TEXTS, ids=lambda t: t[:12])
def test_real_text_never_emits_replacement_char(tokenizer: tokenizers.Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\n").ids
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text  # the tokenizer round-trips this text
    detok = make_detok(tokenizer, prompt)
    pieces = [d.text for d in push_each(detok, ids)]
    assert detok.flush() == ""
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_ascii_tokens_are_emitted_as_soon_as_decoded(tokenizer: tokenizers.Tokenizer) -> None:
    ids = tokenizer.encode(REAL_TEXTS[0]).ids
    detok = make_detok(tokenizer, tokenizer.encode("Repeat:").ids)
    assert [d.text for d in push_each(detok, ids)] == [tokenizer.decode([i]) for i in ids]


def test_partial_character_is_held_until_complete(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer)
    deltas = push_each(detok, [HI, SP_EMOJI_HEAD, EMOJI_TAIL, SP_THERE])
    assert [d.text for d in deltas] == ["Hi", "", " 😀", " there"]
    assert detok.flush() == ""


def test_flush_renders_unfinished_character_like_full_decode(
    tokenizer: tokenizers.Tokenizer,
) -> None:
    detok = make_detok(tokenizer)
    assert [d.text for d in push_each(detok, [HELLO, SP_CJK_HEAD])] == ["Hello", ""]
    assert detok.flush() == " \ufffd"
    assert detok.text == tokenizer.decode([HELLO, SP_CJK_HEAD]) == "Hello \ufffd"


def test_prompt_ending_mid_character_is_not_used_as_seed(tokenizer: tokenizers.Tokenizer) -> None:
    # Full decoding of the output alone cannot see the prompt's first emoji bytes.
    detok = make_detok(tokenizer, [HI, SP_EMOJI_HEAD])
    assert detok.push([EMOJI_TAIL, SP_THERE]).text == "\ufffd there"
    assert detok.flush() == ""
    assert detok.text == tokenizer.decode([EMOJI_TAIL, SP_THERE])


class _SpyTokenizer:
    """Forwards ``decode`` and records the longest id list it was given."""

    def __init__(self, inner: tokenizers.Tokenizer) -> None:
        self.inner = inner
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_small(tokenizer: tokenizers.Tokenizer) -> None:
    ids = tokenizer.encode(" ".join(REAL_TEXTS) * 4).ids
    assert len(ids) > 500
    spy = _SpyTokenizer(tokenizer)
    detok = IncrementalDetokenizer(spy, ids[:10])  # type: ignore[arg-type]
    for i in ids:
        detok.push([i])
    # Longest window: the emitted step's tokens plus the tokens of one unfinished character.
    assert spy.longest <= PROMPT_SEED_TOKENS + 1
    assert detok.flush() == ""
    assert detok.text == tokenizer.decode(ids)


def test_stop_split_across_tokens(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer, stop=["world"])
    deltas = push_each(detok, [HELLO, SP_WOR, LD])
    # Four characters ("world" minus one) are always held back.
    assert deltas == [
        DetokenizerDelta("H", None),
        DetokenizerDelta("ello", None),
        DetokenizerDelta(" ", "world"),
    ]
    assert detok.text == "Hello "
    assert detok.stop_matched == "world"
    assert detok.output_token_ids == [HELLO, SP_WOR, LD]


def test_include_stop_keeps_the_stop_split_across_tokens(tokenizer: tokenizers.Tokenizer):
    """vLLM's include_stop_str_in_output: the text runs to the end of the stop string (held back
    as usual until it is complete), and what follows it in the same token is dropped."""
    detok = make_detok(tokenizer, stop=["wo"], include_stop=True)
    assert detok.push([HELLO, SP_WOR, LD]) == DetokenizerDelta("Hello wo", "wo")  # not the "r"
    assert detok.output_token_ids == [HELLO, SP_WOR]
    detok = make_detok(tokenizer, stop=["world"], include_stop=True)
    deltas = push_each(detok, [HELLO, SP_WOR, LD])
    assert deltas[-1] == DetokenizerDelta(" world", "world")
    assert detok.text == "Hello world" and detok.flush() == ""


def test_no_stop_is_looked_for_in_the_first_min_tokens(tokenizer: tokenizers.Tokenizer) -> None:
    """vLLM's min_tokens: the text of the first outputs is never searched for stop strings (it
    is emitted at once); a stop after them ends the text as usual."""
    ids = [HELLO, SP_WORLD, SP_AGAIN, HELLO, SP_WORLD]
    detok = make_detok(tokenizer, stop=["world"], min_tokens=2)
    deltas = push_each(detok, ids)
    assert [d.text for d in deltas[:2]] == ["Hello", " world"]  # not held back either
    assert detok.stop_matched == "world"
    assert detok.text == "Hello world againHello "
    assert detok.output_token_ids == ids


def test_finished_by_stop_refuses_pushes_and_flushes_empty(
    tokenizer: tokenizers.Tokenizer,
) -> None:
    detok = make_detok(tokenizer, stop=["world"])
    detok.push([HELLO, SP_WORLD])
    with pytest.raises(RuntimeError, match="finished"):
        detok.push([SP_AGAIN])
    assert detok.flush() == ""
    assert detok.text == "Hello "
    assert detok.finished


def test_stop_mid_chunk_drops_later_tokens(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer, stop=["world"])
    assert detok.push([HELLO, SP_WOR, LD, SP_AGAIN]) == DetokenizerDelta("Hello ", "world")
    assert detok.output_token_ids == [HELLO, SP_WOR, LD]


def test_stop_at_first_token(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer, tokenizer.encode("Say hi").ids, stop=["Hello"])
    assert detok.push([HELLO]) == DetokenizerDelta("", "Hello")
    assert detok.text == ""
    assert detok.output_token_ids == [HELLO]


def test_earliest_stop_wins_over_list_order(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer, stop=["world", "lo w"])
    assert detok.push([HELLO, SP_WORLD]) == DetokenizerDelta("Hel", "lo w")


def test_stops_at_same_position_go_to_first_listed(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer, stop=["world", "wo"])
    assert detok.push([HELLO, SP_WORLD]) == DetokenizerDelta("Hello ", "world")


def test_shorter_stop_completing_first_wins(tokenizer: tokenizers.Tokenizer) -> None:
    # "wor" is complete one token before "world" could be.
    detok = make_detok(tokenizer, stop=["world", "wor"])
    assert detok.push([HELLO, SP_WOR, LD]) == DetokenizerDelta("Hello ", "wor")
    assert detok.output_token_ids == [HELLO, SP_WOR]


def test_unmatched_stop_releases_held_text_on_flush(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer, stop=["xyz!"])
    assert [d.text for d in push_each(detok, [HELLO, SP_WORLD])] == ["He", "llo wo"]
    assert detok.flush() == "rld"
    assert detok.text == "Hello world"
    assert detok.stop_matched is None


def test_partial_stop_released_when_text_diverges(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer, stop=["world"])
    deltas = push_each(detok, [HELLO, SP_WOR, RY, SP_AGAIN])
    assert [d.text for d in deltas] == ["H", "ello", " w", "orry a"]
    assert detok.flush() == "gain"
    assert detok.text == "Hello worry again"


def test_stop_made_of_multibyte_character(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer, stop=["😀"])
    deltas = push_each(detok, [HI, SP_EMOJI_HEAD, EMOJI_TAIL])
    assert deltas == [
        DetokenizerDelta("Hi", None),
        DetokenizerDelta("", None),
        DetokenizerDelta(" ", "😀"),
    ]


def test_flush_matches_stop_held_behind_unfinished_character(
    tokenizer: tokenizers.Tokenizer,
) -> None:
    # " " arrives in the same token as half a character, so it is only seen at flush.
    detok = make_detok(tokenizer, stop=["o "])
    assert [d.text for d in push_each(detok, [HELLO, SP_CJK_HEAD])] == ["Hell", ""]
    assert detok.flush() == ""
    assert detok.stop_matched == "o "
    assert detok.text == "Hell"


@pytest.mark.parametrize(
    ("skip_special_tokens", "want"),
    [
        (True, ["Hello", " world", "", " again"]),
        (False, ["Hello", " world", "<|im_end|>", " again"]),
    ],
)
def test_special_tokens(
    tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool, want: list[str]
) -> None:
    ids = [HELLO, SP_WORLD, IM_END, SP_AGAIN]
    detok = make_detok(tokenizer, skip_special_tokens=skip_special_tokens)
    assert [d.text for d in push_each(detok, ids)] == want
    assert detok.flush() == ""
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_stop_on_special_token_text_only_when_rendered(tokenizer: tokenizers.Tokenizer) -> None:
    rendered = make_detok(tokenizer, stop=["<|im_end|>"], skip_special_tokens=False)
    assert rendered.push([HELLO, IM_END, SP_AGAIN]) == DetokenizerDelta("Hello", "<|im_end|>")
    skipped = make_detok(tokenizer, stop=["<|im_end|>"])
    assert skipped.push([HELLO, IM_END, SP_AGAIN]) == DetokenizerDelta("He", None)
    assert skipped.flush() == "llo again"
    assert skipped.stop_matched is None


def test_empty_stop_string_is_rejected(tokenizer: tokenizers.Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        make_detok(tokenizer, stop=["x", ""])


def test_flush_twice_and_push_after_flush(tokenizer: tokenizers.Tokenizer) -> None:
    detok = make_detok(tokenizer)
    detok.push([HELLO])
    assert detok.flush() == ""
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.push([SP_WORLD])
