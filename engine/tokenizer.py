"""Tokenizer and chat template of a model folder (``tokenizers`` + a sandboxed jinja2)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import StrictUndefined, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import InvalidRequestError, UnsupportedModelError


class Tokenizer:
    """Encodes, decodes and renders chat messages the way the model was trained.

    The chat template runs in jinja2's immutable sandbox and message content is passed to it as
    data, never spliced into template source, so content cannot inject template code.
    """

    def __init__(self, model_dir: str | Path) -> None:
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{path} not found")
        self.hf = HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if not template and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self._env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined
        )
        self._env.globals["raise_exception"] = _raise_template_error
        self._compiled = self._env.from_string(template) if template else None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render messages into the prompt text (special tokens included as text)."""
        if self._compiled is None:
            raise InvalidRequestError("this model has no chat template; use completions")
        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """Template, then tokenize (special tokens written in the template are parsed)."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
