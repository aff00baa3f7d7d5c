"""Public request traces for ``tandem bench --trace``: parsing, the replayed slice, the
prefix sharing the trace itself has, and what a replay is asked for and sends (``TraceConfig``,
``TraceStats``; the replay itself is ``bench.trace_workload``).

Formats (``detect_format`` tells them apart by the file's first line):

- ``mooncake``: JSON lines ``{"timestamp": ms, "input_length": n, "output_length": m,
  "hash_ids": [...]}`` (kvcache-ai/Mooncake's ``FAST25-release`` traces). ``hash_ids`` name
  the prompt's ``BLOCK_TOKENS``-token blocks in order, the last one possibly partial: equal ids
  are equal tokens, so requests with the same leading ids share that prefix.
- ``azure``: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` with wall-clock datetimes
  (Azure/AzurePublicDataset's ``AzureLLMInferenceTrace_{conv,code}.csv``). No content: each row
  gets fresh block ids of its own, so no two rows share a block.

Every ``TraceRow`` holds exactly ``ceil(input_tokens / BLOCK_TOKENS)`` block ids (a file
whose ids disagree with its lengths is refused), and times in seconds from the first row.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

BLOCK_TOKENS = 512  # Mooncake's block; also the size of the Azure rows' synthetic blocks
FORMATS = ("mooncake", "azure")
OVERLONG = ("cut", "skip")


class TraceRow(NamedTuple):
    """One request of a trace."""

    time: float  # seconds from the trace's first row
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # one per BLOCK_TOKENS block of the prompt, in order


def blocks_of(n_tokens: int) -> int:
    return math.ceil(n_tokens / BLOCK_TOKENS)


def block_lengths(row: TraceRow) -> list[int]:
    """Tokens of each of ``row``'s blocks: full blocks, then what is left."""
    n = row.input_tokens
    return [min(BLOCK_TOKENS, n - i * BLOCK_TOKENS) for i in range(len(row.hash_ids))]


def detect_format(path: Path) -> str:
    """``mooncake`` (first line a JSON object) or ``azure`` (a CSV header naming its columns)."""
    with path.open() as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if first.startswith("{"):
        return "mooncake"
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(first.split(",")):
        return "azure"
    raise ValueError(f"{path}: not a trace this bench reads (Mooncake JSON lines or Azure CSV)")


def load_trace(path: Path, fmt: str = "auto") -> list[TraceRow]:
    """The rows of ``path`` in arrival order (a stable sort by time)."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "mooncake":
        rows = _mooncake(path)
    elif fmt == "azure":
        rows = _azure(path)
    else:
        raise ValueError(f"unknown trace format {fmt!r}; one of auto, {', '.join(FORMATS)}")
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r.time)
    t0 = rows[0].time
    return [r._replace(time=r.time - t0) for r in rows]


def _mooncake(path: Path) -> list[TraceRow]:
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            row = TraceRow(
                d["timestamp"] / 1000, int(d["input_length"]), int(d["output_length"]),
                tuple(int(h) for h in d["hash_ids"]),
            )  # fmt: skip
            if len(row.hash_ids) != blocks_of(row.input_tokens):
                raise ValueError(
                    f"{path}:{n}: {len(row.hash_ids)} hash_ids for {row.input_tokens} tokens "
                    f"(expected one per {BLOCK_TOKENS}-token block)"
                )
            rows.append(row)
    return rows


def _azure(path: Path) -> list[TraceRow]:
    rows, next_id = [], 0
    with path.open(newline="") as f:
        for d in csv.DictReader(f):
            # Seven fractional digits ("18:17:03.9799600"): fromisoformat reads them in 3.11+.
            # Read as UTC, so that no local clock change falls inside the trace.
            stamp = dt.datetime.fromisoformat(d["TIMESTAMP"].strip())
            t = stamp.replace(tzinfo=dt.UTC).timestamp()
            n_in = int(d["ContextTokens"])
            k = blocks_of(n_in)
            rows.append(
                TraceRow(t, n_in, int(d["GeneratedTokens"]), tuple(range(next_id, next_id + k)))
            )
            next_id += k
    return rows


@dataclass(frozen=True, slots=True)
class Selection:
    """The replayed slice of a trace, after the length caps."""

    rows: tuple[TraceRow, ...]  # as sent: cut rows have their cut lengths and leading ids
    original: tuple[TraceRow, ...]  # the same requests as the trace has them
    arrivals: tuple[float, ...]  # seconds from the first, divided by the speed
    scanned: int  # rows read from ``start`` on to collect them
    cut: int  # prompts cut to the input cap
    skipped: int  # prompts over the input cap left out


def select(
    rows: Sequence[TraceRow],
    limit: int,
    start: float = 0.0,
    speed: float = 1.0,
    max_input: int | None = None,
    max_output: int | None = None,
    overlong: str = "cut",
) -> Selection:
    """The first ``limit`` requests at or after ``start`` seconds, replayed ``speed`` times
    as fast. A prompt over ``max_input`` tokens is cut to its first ``max_input`` tokens (its
    leading blocks, so what it shares stays shared) or, with ``overlong="skip"``, left out
    (and does not count toward ``limit``); outputs over ``max_output`` are cut. Lengths are
    at least 1 (``max_tokens`` must be)."""
    if limit < 1 or speed <= 0:
        raise ValueError("a trace replay needs --num-requests >= 1 and --trace-speed > 0")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, not {overlong!r}")
    kept: list[TraceRow] = []
    original: list[TraceRow] = []
    scanned = cut = skipped = 0
    for row in rows:
        if row.time < start:
            continue
        if len(kept) == limit:
            break
        scanned += 1
        n_in, n_out = max(1, row.input_tokens), max(1, row.output_tokens)
        if max_input is not None and n_in > max_input:
            if overlong == "skip":
                skipped += 1
                continue
            n_in, cut = max_input, cut + 1
        n_out = min(n_out, max_output) if max_output is not None else n_out
        kept.append(TraceRow(row.time, n_in, n_out, row.hash_ids[: blocks_of(n_in)]))
        original.append(row)
    if not kept:
        raise ValueError(f"no request of the trace at or after {start:g} s fits the caps")
    t0 = kept[0].time
    arrivals = tuple((r.time - t0) / speed for r in kept)
    return Selection(tuple(kept), tuple(original), arrivals, scanned, cut, skipped)


@dataclass(frozen=True, slots=True)
class Sharing:
    """How much of the prompts the trace itself says is shared (its block ids)."""

    prompt_tokens: int
    reused_tokens: int  # in leading blocks that an earlier request had
    blocks: int
    unique_blocks: int

    @property
    def reuse(self) -> float:
        """``reused_tokens / prompt_tokens``: what one unbounded prefix cache of the trace's
        blocks, shared by every server, would hit."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def sharing(rows: Sequence[TraceRow]) -> Sharing:
    """The ``Sharing`` of ``rows`` in order. A request reuses the tokens of its leading run of
    blocks whose ids an earlier request had (a prefix cache matches prefixes only); of a block
    seen before only partly (an earlier request's last block), the tokens that request had."""
    seen: dict[int, int] = {}  # block id -> most tokens of it any earlier request had
    total = reused = blocks = 0
    for row in rows:
        lengths = block_lengths(row)
        total += row.input_tokens
        blocks += len(lengths)
        for h, n in zip(row.hash_ids, lengths, strict=True):
            have = seen.get(h, 0)
            reused += min(n, have)
            if have < n:
                break
        for h, n in zip(row.hash_ids, lengths, strict=True):
            seen[h] = max(seen.get(h, 0), n)
    return Sharing(total, reused, blocks, len(seen))


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """What to replay (``tandem bench --trace`` and its flags)."""

    path: str
    num_requests: int = 50
    seed: int = 0
    format: str = "auto"  # or "mooncake", "azure"
    start: float = 0.0  # seconds into the trace
    speed: float = 1.0  # 2.0: arrivals twice as fast
    max_input_len: int | None = None
    max_output_len: int | None = None
    overlong: str = "cut"  # or "skip": prompts over max_input_len
    kind: str = "trace"

    @property
    def name(self) -> str:
        return f"trace:{Path(self.path).stem}"

    def resolved(self) -> TraceConfig:
        return self


@dataclass(frozen=True, slots=True)
class TraceStats:
    """What a replay sends and the sharing the trace itself has, for the results (compare
    ``reuse`` with a server's prefix hit rate on the same run)."""

    trace: str  # the file's name
    format: str
    rows_in_file: int
    start: float
    speed: float
    requests: int
    scanned: int  # rows read from ``start`` on to collect them
    overlong: str  # what happened to prompts over max_input_len: "cut" or "skip"
    max_input_len: int | None
    max_output_len: int | None
    cut: int
    skipped: int
    span_s: float  # first to last arrival, after the speed
    input_tokens: int  # as sent, without any chat template
    output_tokens: int
    reused_tokens: int  # in leading blocks an earlier request of the replay had
    reuse: float  # reused_tokens / input_tokens
    reuse_uncut: float  # the same over the same requests before the caps
    blocks: int
    unique_blocks: int
    exact_prompts: bool  # counted with the model's tokenizer
    inexact_prompts: int  # prompts whose count differed from the trace's (0 when exact)


def describe(t: TraceStats) -> str:
    """One line for the console."""
    over = "" if t.max_input_len is None else (
        f", {t.cut} prompts cut to {t.max_input_len} tokens" if t.overlong == "cut"
        else f", {t.skipped} prompts over {t.max_input_len} tokens skipped"
    )  # fmt: skip
    return (
        f"trace {t.trace} ({t.format}): {t.requests} requests from {t.start:g} s over "
        f"{t.span_s:.1f} s at x{t.speed:g}{over}; {t.input_tokens} prompt tokens, "
        f"{t.reuse:.1%} in blocks seen before ({t.reuse_uncut:.1%} uncut)"
    )
