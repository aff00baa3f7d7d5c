"""Speculative decoding's settings (vLLM's names), checked once when the config is built."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names.

    - ``ngram`` (prompt lookup): the drafts are the ``num_speculative_tokens`` tokens that
      followed the latest earlier occurrence of the sequence's last n tokens (n from
      ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its own history, prompt and
      output. As in vLLM, an unset bound takes the other's value, and both default to 5.
    - ``draft_model``: a smaller model (the folder ``model``, sharing the target's tokenizer)
      proposes ``num_speculative_tokens`` tokens greedily (``engine.draft_model``). As in vLLM,
      a config that names a ``model`` and no ``method`` means this one.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        method = "ngram" if self.method == "[ngram]" else self.method
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported; supported: "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, not {k!r}")
        object.__setattr__(self, "method", method)
        if method == "draft_model":
            self._check_draft()
            return
        if self.model is not None:
            raise ValueError("speculative method 'ngram' takes no 'model'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        assert lo is not None and hi is not None
        if lo < 1 or hi < lo:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_draft(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': the draft's folder")
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("prompt_lookup_min/max belong to method 'ngram', not 'draft_model'")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(
                f"speculative draft model {self.model!r}: no config.json there (a local Hugging "
                "Face folder is expected)"
            )

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """From a dict or a JSON object (``--speculative-config``); None or "" stays None.
        Unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max",
                 "prompt_lookup_min"}  # fmt: skip
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        if "method" not in value and value.get("model") is not None:
            value = {**value, "method": "draft_model"}
        return cls(**value)
