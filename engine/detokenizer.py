"""Incremental detokenization with stop-string matching, one request at a time.

Decoding the whole output after every token costs O(length) per token. Instead we keep a small
token window, as vLLM does::

    ids:  ... | prefix_offset ........ read_offset ........ len(ids)
                 \\__ already emitted __/ \\__ not yet emitted __/

``decode(ids[prefix_offset:])`` minus ``decode(ids[prefix_offset:read_offset])`` is the new
text. The already-emitted tokens in the window give the decoder the context it needs (a leading
space, a merge across the boundary). While the new text ends in U+FFFD the last token holds an
incomplete UTF-8 sequence (byte-level BPE splits characters across tokens), so nothing is
emitted and the window grows until the character completes. The window starts on the last few
prompt tokens so the first output token decodes as it would after the prompt.

Stop strings are matched on text. The last ``max(len(stop)) - 1`` characters are held back so a
stop split across tokens is never partly emitted; the text before a stop is emitted, the stop
itself only with ``include_stop`` (vLLM's ``include_stop_str_in_output``). The text of the
first ``min_tokens`` outputs is not searched for stops (vLLM's ``min_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers

# Prompt tokens that seed the decode window (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_SEED_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DetokenizerDelta:
    """What one :meth:`IncrementalDetokenizer.push` produced."""

    text: str
    """New text safe to emit now; may be empty."""
    stop_matched: str | None
    """The stop string that ended the sequence, if one did."""


class IncrementalDetokenizer:
    """Turns generated token ids into text pieces, never emitting a broken character or a stop.

    Without a stop match, the pieces returned by :meth:`push` plus :meth:`flush` concatenate to
    ``tokenizer.decode(output_token_ids, skip_special_tokens=...)`` exactly. After a stop
    matches (in ``push`` or in ``flush``) the object is finished: :meth:`push` raises
    ``RuntimeError`` and :meth:`flush` returns ``""``.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty (got {list(stop)!r})")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        seed = self._safe_seed(list(prompt_token_ids[-PROMPT_SEED_TOKENS:]))
        self._ids: list[int] = seed
        self._num_seed = len(seed)
        self._prefix_offset = 0
        self._read_offset = len(seed)
        self._pending = ""  # decoded, not yet emitted: held back for stop matching
        self._emitted: list[str] = []
        self._stop_matched: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far, by :meth:`push` and :meth:`flush`."""
        return "".join(self._emitted)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated token ids pushed so far, up to the token that completed a stop (a copy)."""
        return self._ids[self._num_seed :]

    @property
    def stop_matched(self) -> str | None:
        """The stop string that ended the sequence, whether found by ``push`` or ``flush``."""
        return self._stop_matched

    @property
    def finished(self) -> bool:
        """True once a stop matched or :meth:`flush` was called."""
        return self._finished

    def push(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Feed newly generated tokens; return the text that can be emitted now.

        Tokens are taken one at a time: if a stop completes on one of them, the rest of
        ``token_ids`` is dropped (not in :attr:`output_token_ids`) and the delta carries the text
        up to the stop.
        """
        if self._finished:
            raise RuntimeError(
                f"detokenizer is finished (stop_matched={self._stop_matched!r}); no more tokens"
            )
        pieces: list[str] = []
        for token_id in token_ids:
            self._ids.append(token_id)
            piece = self._absorb(self._decode_step())
            pieces.append(piece)
            if self._finished:
                break
        text = "".join(pieces)
        if text:
            self._emitted.append(text)
        return DetokenizerDelta(text=text, stop_matched=self._stop_matched)

    def flush(self) -> str:
        """Finish the sequence (eos, length, abort): return the text still held back.

        Includes a trailing incomplete character as U+FFFD, exactly as full decoding renders it.
        Stops are matched on this last text too; ``""`` if the sequence already finished.
        """
        if self._finished:
            return ""
        tail = self._decode_tail()
        self._read_offset = len(self._ids)
        self._pending += tail
        index, matched = self._find_stop(self._pending)
        self._finished = True
        text = self._pending if matched is None else self._pending[:index]
        self._stop_matched = matched
        self._pending = ""
        if text:
            self._emitted.append(text)
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _safe_seed(self, seed: list[int]) -> list[int]:
        """Drop the prompt seed if it ends inside a character.

        Otherwise the first output bytes would complete that character in the window while full
        decoding of the output alone renders them as U+FFFD.
        """
        if seed and self._decode(seed).endswith(REPLACEMENT_CHAR):
            return []
        return seed

    def _decode_tail(self) -> str:
        """Text of ``ids[read_offset:]`` decoded in the context of the window's prefix."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        return new_text[len(prefix_text) :]

    def _decode_step(self) -> str:
        """Decode the newest tokens; advance the window only over complete characters."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # An empty or shrunken delta can still change once more tokens arrive (a skipped special
        # token, a decoder that joins pieces), so the window only moves past visible text.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _absorb(self, delta: str) -> str:
        """Add decoded text to the held-back text; return what may be emitted now."""
        if not delta:
            return ""
        self._pending += delta
        if len(self._ids) - self._num_seed <= self._min_tokens:  # no stop in these yet
            text, self._pending = self._pending, ""
            return text
        index, matched = self._find_stop(self._pending)
        if matched is not None:
            text = self._pending[:index]
            self._pending = ""
            self._stop_matched = matched
            self._finished = True
            return text
        # Keep the last `hold` characters: they may be the start of a stop string.
        cut = max(len(self._pending) - self._hold, 0)
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text

    def _find_stop(self, text: str) -> tuple[int, str | None]:
        """Where the text ends at the earliest occurrence of any stop string in ``text`` (before
        it, or after it with ``include_stop``), and that stop; ties go to the one listed first.

        Emitted text never holds a stop and ``text`` holds the last ``hold`` characters before
        the new ones, so an occurrence here is the earliest in the whole output.
        """
        best_index, best = -1, None
        for s in self._stop:
            index = text.find(s)
            if index != -1 and (best is None or index < best_index):
                best_index, best = index, s
        if best is not None and self._include_stop:
            best_index += len(best)
        return best_index, best
