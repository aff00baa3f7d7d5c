"""Tokenizer and chat template of a model folder (``tokenizers`` + a sandboxed jinja2)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import StrictUndefined, Template, TemplateError
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
        # The same vocabulary, encoding special-token text ("<|im_end|>") as plain characters:
        # used for message content, which is data and must never forge a role boundary.
        self._text_hf = HFTokenizer.from_file(str(path))
        self._text_hf.encode_special_tokens = True
        self._specials = tuple(
            t.content for t in self.hf.get_added_tokens_decoder().values() if t.special
        )
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
        self._env.filters["tojson"] = _tojson  # as transformers renders templates
        self._compiled = self._env.from_string(template) if template else None

    @property
    def supports_tools(self) -> bool:
        """Whether the model's own chat template renders ``tools`` (a template that never
        mentions them would silently drop the tool definitions)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def compile_template(self, source: str) -> Template:
        """Compile another chat template in the same sandbox (e.g. a tool-calling template for
        a model whose own template has no tool support)."""
        return self._env.from_string(source)

    def holds_special(self, text: str) -> bool:
        """Whether ``text`` contains the text of a special token (``<|im_end|>``, ...)."""
        return any(t in text for t in self._specials)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``: with those the tokenizer's own
        post-processor adds (a Llama tokenizer's BOS), as vLLM and transformers tokenize a raw
        prompt (`encode_prompt`). Through the batch call, which releases the GIL while it runs
        (the single one holds it): a server tokenizing in worker threads keeps its event loop
        and other threads running meanwhile. The ids are the same."""
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw prompt's token ids (completions, embeddings, the offline API's strings): with
        the tokenizer's special tokens by default, as vLLM's ``add_special_tokens`` (a Llama
        model's prompt starts with its BOS; a chat template writes its own, so chat does not
        come here)."""
        return self.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template: Template | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages into the prompt text (special tokens included as text), with the
        model's template or ``template``; ``kwargs`` (e.g. ``tools``) are template variables."""
        compiled = template or self._compiled
        if compiled is None:
            raise InvalidRequestError("this model has no chat template; use completions")
        try:
            return compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """Template, then tokenize. Special tokens written by the template are parsed; message
        content is text: special-token text inside it (a user's ``<|im_end|>``) is encoded as
        ordinary characters, so content can never open or close a turn. Content without such
        text is tokenized exactly as the whole rendered prompt always was."""
        text = self.apply_chat_template(messages, **kwargs)
        if not any(self._holds_special(m.get("content")) for m in messages):
            return self.encode(text)
        return self._encode_content_as_text(messages, text, **kwargs)

    def _holds_special(self, content: Any) -> bool:
        return isinstance(content, str) and any(t in content for t in self._specials)

    def _encode_content_as_text(
        self, messages: Sequence[Mapping[str, Any]], text: str, **kwargs: Any
    ) -> list[int]:
        """Render again with unique markers in place of the contents that hold special-token
        text, split the result at the markers, and encode the template's pieces with special
        tokens and the contents as text. Refuses a template that alters such content (the
        pieces would no longer add up to the prompt it renders)."""
        nonce = secrets.token_hex(8)
        contents: dict[str, str] = {}
        marked = []
        for i, m in enumerate(messages):
            msg = dict(m)
            if self._holds_special(msg.get("content")):
                mark = f"\ue000{nonce}-{i}\ue001"
                contents[mark] = msg["content"]
                msg["content"] = mark
            marked.append(msg)
        skeleton = self.apply_chat_template(marked, **kwargs)
        pattern = "(" + "|".join(re.escape(mark) for mark in contents) + ")"
        ids: list[int] = []
        rebuilt: list[str] = []
        for piece in re.split(pattern, skeleton):
            if piece in contents:
                ids += self._text_hf.encode(contents[piece], add_special_tokens=False).ids
                rebuilt.append(contents[piece])
            elif piece:
                ids += self.encode(piece)
                rebuilt.append(piece)
        if "".join(rebuilt) != text:
            raise InvalidRequestError(
                "this chat template rewrites message content, so content holding special-token "
                f"text ({', '.join(self._specials[:3])}, ...) cannot be kept as text; remove it"
            )
        return ids


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    """jinja2's ``tojson`` escapes ``<`` and ``>`` for HTML; chat templates want plain JSON."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
