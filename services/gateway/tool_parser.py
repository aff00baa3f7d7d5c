"""Tool calls out of generated text, incrementally: content deltas and OpenAI tool-call deltas.

Two formats:

- ``hermes`` (Qwen2.5, SmolLM2 and other ChatML models): ``<tool_call>\\n{"name": ..,
  "arguments": {..}}\\n</tool_call>``, one block per call, text allowed around them (a block
  holding a JSON list of calls is accepted too);
- ``llama3_json`` (Llama 3.1/3.2): the whole output is ``{"name": .., "parameters": {..}}``,
  several joined by ``;``; output that does not start with ``{`` is plain content.

A call is streamed as it is written: its id and name as soon as ``"name"`` and the start of the
arguments are seen, then the arguments text piece by piece (a small scanner finds where the
arguments object ends, strings and escapes included). A call written in another shape is
emitted whole when its block ends. The same parser serves non-streamed responses (one ``feed``
of the whole text), so both forms agree.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


@dataclass(slots=True)
class CallDelta:
    """A piece of tool call ``index``: ``id`` and ``name`` come with its first piece only."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Parsed:
    """What one ``feed`` or ``finish`` produced."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _Args:
    """Finds the end of a JSON value fed piece by piece (object or array at the top)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def take(self, text: str) -> int:
        """How many leading characters of ``text`` belong to the value (all, if unfinished)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallParser:
    """Splits one choice's output into content and tool calls (see the module docstring)."""

    def __init__(self, fmt: str) -> None:
        if fmt not in PARSERS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(PARSERS)}")
        self.fmt = fmt
        self.num_calls = 0
        self._buf = ""
        self._state = "start" if fmt == "llama3_json" else "text"
        self._args: _Args | None = None
        self._ws = ""  # whitespace held back: content never starts or ends with it
        self._said = False  # some content emitted

    @property
    def open_tag(self) -> str:
        return "<tool_call>" if self.fmt == "hermes" else ""

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        """The end of the output: flush what was held back."""
        out = Parsed()
        while self._step(out):
            pass
        rest, self._buf = self._buf, ""
        if self._state in ("text", "start", "plain"):
            self._content(out, rest, final=True)
        elif self._state == "block":  # never became a call we could read: keep it as text
            self._whole_block(out, rest, final=True)
        return out

    # -- the state machine --------------------------------------------------------------------
    def _step(self, out: Parsed) -> bool:
        """Consume what can be decided from the buffer; True when the state changed."""
        if self._state == "start":
            return self._start()
        if self._state == "plain":
            self._content(out, self._buf)
            self._buf = ""
            return False
        if self._state == "text":
            return self._text(out)
        if self._state == "block":
            return self._block(out)
        if self._state == "args":
            return self._arguments(out)
        return self._after(out)

    def _start(self) -> bool:
        """llama3_json: a call if the output starts with ``{``, else plain content."""
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        self._state = "block" if stripped.startswith("{") else "plain"
        return True

    def _text(self, out: Parsed) -> bool:
        tag = self.open_tag
        at = self._buf.find(tag)
        if at >= 0:
            self._content(out, self._buf[:at])
            self._buf = self._buf[at + len(tag) :]
            self._state = "block"
            return True
        keep = _partial_suffix(self._buf, tag)  # a tag may be arriving
        self._content(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _block(self, out: Parsed) -> bool:
        m = _HEADER.match(self._buf)
        if m is not None and self._buf[m.end()] == "{":
            out.calls.append(CallDelta(self.num_calls, "", new_call_id(), _unescape(m.group(1))))
            self._buf = self._buf[m.end() :]
            self._args, self._state = _Args(), "args"
            return True
        end = self._block_end()
        if end is not None:  # a complete block in another shape: parse it whole
            self._whole_block(out, self._buf[:end], final=False)
            self._buf = self._buf[end:]
            self._state = "after"
            return True
        return False

    def _arguments(self, out: Parsed) -> bool:
        assert self._args is not None
        n = self._args.take(self._buf)
        if n:
            out.calls.append(CallDelta(self.num_calls, self._buf[:n]))
        self._buf = self._buf[n:]
        if not self._args.done:
            return False
        self.num_calls += 1
        self._state = "after"
        return True

    def _after(self, out: Parsed) -> bool:
        """Skip the rest of a call's block: the closing brace and tag (hermes) or the ``;``
        before the next call (llama3_json)."""
        if self.fmt == "hermes":
            at = self._buf.find("</tool_call>")
            if at < 0:
                return False
            self._buf = self._buf[at + len("</tool_call>") :]
            self._state = "text"
            return True
        at = self._buf.find(";")
        if at < 0:
            return False
        self._buf = self._buf[at + 1 :]
        self._state = "start"
        return True

    def _block_end(self) -> int | None:
        if self.fmt == "hermes":
            at = self._buf.find("</tool_call>")
            return None if at < 0 else at
        return None  # llama3_json: a whole-call parse happens only at the end

    def _whole_block(self, out: Parsed, block: str, final: bool) -> None:
        """A call block not in the streamable shape: emit its calls, or the text as content."""
        try:
            value = json.loads(block)
        except ValueError:
            value = None
        calls = value if isinstance(value, list) else [value]
        if not calls or not all(_is_call(c) for c in calls):
            self._content(out, (self.open_tag + block) if self.fmt == "hermes" else block, final)
            return
        for c in calls:
            args = c.get("arguments", c.get("parameters", {}))
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out.calls.append(CallDelta(self.num_calls, text, new_call_id(), c["name"]))
            self.num_calls += 1

    def _content(self, out: Parsed, text: str, final: bool = False) -> None:
        """Emit ``text`` as content, holding back leading and trailing whitespace."""
        text = self._ws + text
        body = text.rstrip()
        self._ws = "" if final else text[len(body) :]
        if not self._said:
            body = body.lstrip()
        if body:
            out.content += body
            self._said = True


def _is_call(value: object) -> bool:
    return isinstance(value, dict) and isinstance(value.get("name"), str)


def _unescape(name: str) -> str:
    try:
        return json.loads(f'"{name}"')
    except ValueError:
        return name


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def merge(parts: list[Parsed]) -> tuple[str, list[dict]]:
    """The content and the complete ``tool_calls`` (OpenAI message form) of ``parts``."""
    content = "".join(p.content for p in parts)
    calls: dict[int, dict] = {}
    for p in parts:
        for d in p.calls:
            call = calls.setdefault(
                d.index, {"id": d.id, "type": "function", "function": {"name": d.name}}
            )
            fn = call["function"]
            fn["arguments"] = fn.get("arguments", "") + d.arguments
    return content, [calls[i] for i in sorted(calls)]
