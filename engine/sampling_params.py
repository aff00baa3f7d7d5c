"""Per-request sampling parameters, validated on construction, and the log-probabilities of
the tokens a request gets back (`TokenLogprob`). No torch: the gateway and router use them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidSamplingParamsError
from engine.grammar import GrammarSpec

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_TOP_LOGPROBS = 20
# top_k travels as int32 between services; any value >= the vocabulary means "no top-k".
MAX_TOP_K = 2**31 - 1
_MAX_REPR = 120  # error messages quote at most this much of a bad value
MAX_N = 128  # choices per request (OpenAI's limit)
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI
MAX_LOGIT_BIAS_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` disables top-k. ``logprobs=None`` returns no
    logprobs; ``logprobs=k`` returns the chosen token's logprob plus the ``k`` most likely
    alternatives (``0 <= k <= 20``). Log-probabilities are those of the raw model distribution
    (before penalties, temperature and truncation), as OpenAI reports them.

    ``n`` choices are sampled from one prompt: the prompt is computed once and its KV blocks are
    shared (copy-on-write); with a ``seed``, choice ``i`` draws from seed ``seed + i``.
    ``logit_bias`` holds ``(token_id, bias)`` pairs added to the logits before sampling.
    ``grammar`` constrains every output token to keep the text a prefix of the grammar's language
    (JSON schema, Lark or regex; see ``engine.grammar``).

    vLLM's: ``min_tokens`` outputs come before the sequence may end (EOS and ``stop_token_ids``
    are masked until then, and stop strings are not looked for in their text);
    ``include_stop_str_in_output`` keeps the stop string, or the text of the stop token (EOS or
    one of ``stop_token_ids``), that ended the sequence in its text, which leaves it out by
    default; ``skip_special_tokens=False`` keeps special tokens' text.

    ``booked_tokens`` is for admission only: the completion tokens per choice that the services'
    admission ledgers book for the request (``0 <= booked_tokens <= max_tokens``; 0: book
    ``max_tokens``). Generation ignores it by design: a request runs to ``max_tokens`` whatever
    it booked (`services.common.admission.request_cost`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    grammar: GrammarSpec | None = None
    booked_tokens: int = 0

    def __post_init__(self) -> None:
        # Accept lists/str for convenience but store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidSamplingParamsError:
            got = repr(getattr(self, name))
            got = got if len(got) <= _MAX_REPR else got[:_MAX_REPR] + "..."
            return InvalidSamplingParamsError(f"{name}: {why} (got {got})")

        _check_int(self, "max_tokens", 1, None, bad)
        _check_int(self, "min_tokens", 0, self.max_tokens, bad)
        _check_int(self, "booked_tokens", 0, self.max_tokens, bad)
        _check_float(self, "temperature", 0.0, 100.0, bad)
        _check_float(self, "top_p", 0.0, 1.0, bad)
        if self.top_p == 0.0:
            raise bad("top_p", "must be in (0, 1]")
        _check_int(self, "top_k", 0, MAX_TOP_K, bad)
        _check_float(self, "min_p", 0.0, 1.0, bad)
        _check_float(self, "presence_penalty", -2.0, 2.0, bad)
        _check_float(self, "frequency_penalty", -2.0, 2.0, bad)
        _check_float(self, "repetition_penalty", 0.0, 10.0, bad)
        if self.repetition_penalty == 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if self.seed is not None:
            _check_int(self, "seed", -(2**63), 2**64 - 1, bad)
        if self.logprobs is not None:
            _check_int(self, "logprobs", 0, MAX_TOP_LOGPROBS, bad)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise bad(
                    "stop",
                    f"each stop must be a non-empty string of <= "
                    f"{MAX_STOP_STRING_CHARS} characters",
                )
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("stop_token_ids", "must be non-negative integers")
        _check_int(self, "n", 1, MAX_N, bad)
        self._validate_logit_bias(bad)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise bad("grammar", "must be a GrammarSpec")
        if self.grammar is not None and self.min_tokens:
            # A finished grammar allows nothing but EOS, which min_tokens would mask.
            raise bad("min_tokens", "cannot be combined with a grammar (structured output)")

    def _validate_logit_bias(self, bad) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        for t, b in self.logit_bias:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("logit_bias", "token ids must be non-negative integers")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
                raise bad("logit_bias", "biases must be finite numbers")
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"biases must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")


def _check_int(p: SamplingParams, name: str, lo: int | None, hi: int | None, bad) -> None:
    v = getattr(p, name)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(name, "must be an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(name, f"must be in [{lo}, {hi if hi is not None else 'inf'}]")


def _check_float(p: SamplingParams, name: str, lo: float, hi: float, bad) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, "must be a finite number")
    if not lo <= v <= hi:
        raise bad(name, f"must be in [{lo}, {hi}]")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Raw-model log-probability of the chosen token and of the ``params.logprobs`` best ones.

    ``top`` holds ``(token_id, logprob)`` pairs, most likely first; it is empty when
    ``params.logprobs == 0``. ``rank``: the token's 1-based rank in its distribution (1: the
    most likely), where computed (prompt logprobs); 0 where not.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int = 0
