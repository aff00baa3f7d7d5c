"""Benchmark workloads: request specs generated from a seed, with no downloads.

Prompt text is drawn from a fixed list of common English words. Given a model folder, lengths
are measured with its ``tokenizer.json`` and cut to the exact token count; without one they are
approximated from a words-per-token ratio measured once on SmolLM2's tokenizer. Lengths count
message *content* tokens; the server adds its chat template on top (its ``usage`` reports the
real prompt length, and that is what the records keep).

Kinds (``WorkloadConfig.kind``), defaults in ``DEFAULTS`` (overridable by flags):

- ``random``: input and output lengths uniform in ``mean * (1 +- spread)`` (vLLM's
  ``--random-range-ratio``).
- ``chat``: ShareGPT-like heavy-tailed lengths, log-normal. The means are what the vLLM paper
  (Kwon et al., SOSP 2023, section 6.1) reports for ShareGPT: 161 input and 338 output tokens
  on average. ShareGPT length histograms are long-tailed on a linear axis and roughly
  bell-shaped on a log axis, hence log-normal; the spreads (sigma of the log: 1.0 for inputs,
  0.8 for outputs) are our choice to give a median about 0.6x the mean and a p99 near 6x the
  median, and lengths are clipped to [4, 4096] and [4, 2048].
- ``shared-prefix``: ``num_prefixes`` long system prompts of ``prefix_len`` tokens, each
  shared by its share of the requests (round robin), plus a short distinct user question.
- ``multi-turn``: sessions of ``turns`` turns; each turn resends the whole history (earlier
  user turns and synthetic assistant replies of the earlier turns' output lengths, so every
  endpoint receives byte-identical requests). A session's turns run one after another.
- ``prefill-heavy``: long prompts, short answers. ``decode-heavy``: short prompts, long answers.

A public trace's replay (``--trace``) is a workload too: ``bench.trace_workload``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from bench.words import WORDS

if TYPE_CHECKING:
    from bench.traces import TraceConfig, TraceStats

KINDS = ("random", "chat", "shared-prefix", "multi-turn", "prefill-heavy", "decode-heavy")

# kind -> (input mean, input spread, output mean, output spread)
DEFAULTS: dict[str, tuple[int, float, int, float]] = {
    "random": (256, 0.5, 128, 0.5),
    "chat": (161, 1.0, 338, 0.8),
    "shared-prefix": (64, 0.5, 64, 0.5),
    "multi-turn": (64, 0.5, 64, 0.5),
    "prefill-heavy": (1024, 0.25, 16, 0.25),
    "decode-heavy": (32, 0.25, 512, 0.25),
}
CHAT_INPUT_CLIP, CHAT_OUTPUT_CLIP = (4, 4096), (4, 2048)

SENTENCE_WORDS = 10  # a period every ten words
# Tokens per generated word, measured on SmolLM2-135M-Instruct's tokenizer (1.105 over 20k
# words of this list, periods included); used when no tokenizer is given.
APPROX_TOKENS_PER_WORD = 1.1


class TokenCounter(Protocol):
    """Counts tokens of text and cuts text to a token count."""

    exact: bool

    def count(self, text: str) -> int: ...

    def cut(self, text: str, n: int) -> str: ...


class ApproxCounter:
    """Word-based estimate, for endpoints whose tokenizer is not at hand."""

    exact = False

    def count(self, text: str) -> int:
        return round(len(text.split()) * APPROX_TOKENS_PER_WORD)

    def cut(self, text: str, n: int) -> str:
        lead = text[: len(text) - len(text.lstrip())]  # a leading space is kept, as a tokenizer's
        return lead + " ".join(text.split()[: max(1, round(n / APPROX_TOKENS_PER_WORD))])


class TokenizerCounter:
    """Exact counts with a model folder's ``tokenizer.json`` (no special tokens added)."""

    exact = True

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def cut(self, text: str, n: int) -> str:
        """The longest prefix of ``text`` ending on a token boundary that re-encodes to ``n``
        tokens (BPE can merge differently at the cut, so a few boundaries are tried)."""
        offsets = self._tok.encode(text, add_special_tokens=False).offsets
        if len(offsets) <= n:
            return text
        best = text[: offsets[n - 1][1]]
        for k in (n, n + 1, n - 1, n + 2, n - 2):
            if 0 < k <= len(offsets):
                candidate = text[: offsets[k - 1][1]]
                if self.count(candidate) == n:
                    return candidate
        return best


def make_counter(tokenizer_dir: str | Path | None) -> TokenCounter:
    """Exact counting with ``tokenizer_dir/tokenizer.json`` if it exists, else approximate."""
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return TokenizerCounter(tokenizer_dir)
    return ApproxCounter()


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: the messages to send and the length targets (content tokens in, output
    tokens out; the output target is ``max_tokens``, exact when ``ignore_eos`` is honoured)."""

    request_id: str
    messages: tuple[Message, ...]
    input_tokens: int
    output_tokens: int
    session: int | None = None
    turn: int = 0

    @property
    def prompt(self) -> str:
        """The messages as one text, for the completions API."""
        return "\n\n".join(m.content for m in self.messages)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What to generate; ``None`` lengths take the kind's ``DEFAULTS``."""

    kind: str
    num_requests: int
    seed: int = 0
    input_len: int | None = None
    input_spread: float | None = None
    output_len: int | None = None
    output_spread: float | None = None
    prefix_len: int = 1024
    num_prefixes: int = 1
    turns: int = 4

    @property
    def name(self) -> str:
        return self.kind

    def resolved(self) -> WorkloadConfig:
        """This config with the kind's defaults filled in."""
        if self.kind not in DEFAULTS:
            raise ValueError(f"unknown workload {self.kind!r}; one of {', '.join(KINDS)}")
        i, i_s, o, o_s = DEFAULTS[self.kind]
        return replace(
            self,
            input_len=i if self.input_len is None else self.input_len,
            input_spread=i_s if self.input_spread is None else self.input_spread,
            output_len=o if self.output_len is None else self.output_len,
            output_spread=o_s if self.output_spread is None else self.output_spread,
        )


# ``--workload KIND:key=value,...`` keys -> WorkloadConfig fields
SPEC_KEYS = {
    "input": ("input_len", int),
    "input_spread": ("input_spread", float),
    "output": ("output_len", int),
    "output_spread": ("output_spread", float),
    "prefix": ("prefix_len", int),
    "prefixes": ("num_prefixes", int),
    "turns": ("turns", int),
}


def parse_workload(text: str, base: WorkloadConfig) -> WorkloadConfig:
    """``prefill-heavy`` or ``prefill-heavy:input=512,output=8``: ``base`` with that kind and
    those fields replaced (keys: ``SPEC_KEYS``)."""
    kind, _, rest = text.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown workload {kind!r}; one of {', '.join(KINDS)}")
    changes: dict = {"kind": kind}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in SPEC_KEYS or not value:
            raise ValueError(f"{text}: use key=value with keys {', '.join(SPEC_KEYS)}")
        field, cast = SPEC_KEYS[key]
        changes[field] = cast(value)
    return replace(base, **changes)


@dataclass(frozen=True, slots=True)
class Workload:
    """Generated requests, grouped in units: one request, or the turns of one session. A
    trace replay (``bench.trace_workload``) also has its units' arrival offsets (seconds) and
    the trace's stats."""

    config: WorkloadConfig | TraceConfig
    units: tuple[tuple[RequestSpec, ...], ...]
    exact_lengths: bool
    arrivals: tuple[float, ...] | None = None
    trace: TraceStats | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def requests(self) -> list[RequestSpec]:
        return [r for unit in self.units for r in unit]


class TextMaker:
    """Seeded word text of a given token length."""

    def __init__(self, rng: random.Random, counter: TokenCounter) -> None:
        self.rng, self.counter = rng, counter

    def words(self, n: int) -> str:
        out = []
        for i in range(n):
            w = self.rng.choice(WORDS)
            out.append(w.capitalize() if i % SENTENCE_WORDS == 0 else w)
            if i % SENTENCE_WORDS == SENTENCE_WORDS - 1:
                out[-1] += "."
        return " ".join(out)

    def text(self, n_tokens: int, lead: str = "") -> str:
        """Text of ``n_tokens`` tokens (exactly, with an exact counter; else about), starting
        with ``lead`` (a space: text that follows other text on a token boundary)."""
        text = lead + self.words(math.ceil(n_tokens / APPROX_TOKENS_PER_WORD) + 8)
        while self.counter.count(text) < n_tokens:
            text += " " + self.words(n_tokens // 4 + 8)
        return self.counter.cut(text, n_tokens)


def uniform_length(rng: random.Random, mean: int, spread: float) -> int:
    low = max(1, round(mean * (1 - spread)))
    return rng.randint(low, max(low, round(mean * (1 + spread))))


def lognormal_length(rng: random.Random, mean: int, sigma: float, clip: tuple[int, int]) -> int:
    """Log-normal with the given mean (mu = ln(mean) - sigma^2 / 2), clipped."""
    mu = math.log(mean) - sigma * sigma / 2
    return min(clip[1], max(clip[0], round(rng.lognormvariate(mu, sigma))))


def generate(config: WorkloadConfig, counter: TokenCounter) -> Workload:
    """The workload of ``config``; the same config and counter give the same requests."""
    c = config.resolved()
    assert c.input_len is not None and c.output_len is not None
    assert c.input_spread is not None and c.output_spread is not None
    rng = random.Random(f"{c.kind}:{c.seed}")
    maker = TextMaker(rng, counter)

    def lengths() -> tuple[int, int]:
        if c.kind == "chat":
            return (
                lognormal_length(rng, c.input_len, c.input_spread, CHAT_INPUT_CLIP),
                lognormal_length(rng, c.output_len, c.output_spread, CHAT_OUTPUT_CLIP),
            )
        return (
            uniform_length(rng, c.input_len, c.input_spread),
            uniform_length(rng, c.output_len, c.output_spread),
        )

    if c.kind == "multi-turn":
        units = _sessions(c, maker, lengths, counter)
    else:
        prefixes = [maker.text(c.prefix_len) for _ in range(c.num_prefixes)]
        requests = []
        for i in range(c.num_requests):
            n_in, n_out = lengths()
            msgs = (Message("user", maker.text(n_in)),)
            if c.kind == "shared-prefix":
                msgs = (Message("system", prefixes[i % c.num_prefixes]), *msgs)
            total = sum(counter.count(m.content) for m in msgs)
            requests.append(RequestSpec(f"r{i:05d}", msgs, total, n_out))
        units = [(r,) for r in requests]
    return Workload(c, tuple(units), counter.exact)


def _sessions(c: WorkloadConfig, maker: TextMaker, lengths, counter: TokenCounter):
    units = []
    made = 0
    for s in range(math.ceil(c.num_requests / c.turns)):
        history: list[Message] = []
        turns = []
        for t in range(min(c.turns, c.num_requests - made)):
            n_in, n_out = lengths()
            history.append(Message("user", maker.text(n_in)))
            total = sum(counter.count(m.content) for m in history)
            turns.append(RequestSpec(f"s{s:04d}t{t}", tuple(history), total, n_out, s, t))
            history.append(Message("assistant", maker.text(n_out)))
            made += 1
        units.append(tuple(turns))
    return units
