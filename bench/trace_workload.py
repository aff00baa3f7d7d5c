"""The ``--trace`` workload: a public trace's requests (``bench.traces``) as prompts of the
trace's lengths and sharing, sent at the trace's own times.

Prompts are built block by block. Each block id of the trace is one text of exactly
``BLOCK_TOKENS`` tokens (with a tokenizer; about that many without), drawn from the word list
with a generator seeded by (``seed``, id): equal ids give byte-identical blocks, different ids
different ones, and a request's prompt is its blocks' texts one after another (a last, partial
block is the first tokens of its block's text). So two requests with the same leading ids send
the same leading text, and every prefix cache and KV-aware router sees the sharing the trace
saw. The seed changes every block, so each rate of a sweep gets fresh prompts.

Token-exact concatenation: a block after the first starts with a space and a word, and the
byte-level pre-tokenizers of GPT-2, Llama 3 or Qwen 2 (and SentencePiece's word pieces) never
merge across a space that precedes a word, so the prompt's tokens are the blocks' tokens laid
end to end (a prompt's first block has no leading space, as a chat template that trims content
would drop it). With a tokenizer every prompt is counted again and any that is not exact is
counted in ``TraceStats.inexact_prompts``. With the chat API the server's template adds the
same header to every prompt: sharing keeps its block structure, shifted by the header.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from bench.traces import (
    BLOCK_TOKENS,
    FORMATS,
    OVERLONG,
    Selection,
    TraceConfig,
    TraceRow,
    TraceStats,
    block_lengths,
    detect_format,
    load_trace,
    select,
    sharing,
)
from bench.workloads import Message, RequestSpec, TextMaker, TokenCounter, Workload


class BlockTexts:
    """The text of each block id: seeded by (``seed``, id), cached, ``BLOCK_TOKENS`` tokens."""

    def __init__(self, seed: int, counter: TokenCounter) -> None:
        self.seed, self.counter = seed, counter
        self._full: dict[tuple[int, bool], str] = {}
        self._part: dict[tuple[int, bool, int], str] = {}

    def full(self, block_id: int, first: bool) -> str:
        """The whole block; ``first``: the prompt's first block (no leading space)."""
        key = (block_id, first)
        if key not in self._full:
            maker = TextMaker(random.Random(f"trace:{self.seed}:{block_id}"), self.counter)
            self._full[key] = maker.text(BLOCK_TOKENS, lead="" if first else " ")
        return self._full[key]

    def text(self, block_id: int, first: bool, n_tokens: int) -> str:
        """The block's first ``n_tokens`` tokens."""
        if n_tokens >= BLOCK_TOKENS:
            return self.full(block_id, first)
        key = (block_id, first, n_tokens)
        if key not in self._part:
            self._part[key] = self.counter.cut(self.full(block_id, first), n_tokens)
        return self._part[key]

    def prompt(self, row: TraceRow) -> str:
        lengths = block_lengths(row)
        return "".join(
            self.text(h, i == 0, n)
            for i, (h, n) in enumerate(zip(row.hash_ids, lengths, strict=True))
        )


def generate_trace(config: TraceConfig, counter: TokenCounter) -> Workload:
    """The replay of ``config``: one unit per request, the trace's arrivals (scaled) and its
    stats. The same config and counter give the same requests."""
    path = Path(config.path)
    fmt = detect_format(path) if config.format == "auto" else config.format
    rows = load_trace(path, fmt)
    sel = select(
        rows, config.num_requests, config.start, config.speed, config.max_input_len,
        config.max_output_len, config.overlong,
    )  # fmt: skip
    blocks = BlockTexts(config.seed, counter)
    units, inexact = [], 0
    for i, row in enumerate(sel.rows):
        text = blocks.prompt(row)
        n = row.input_tokens
        if counter.exact:
            n = counter.count(text)
            inexact += n != row.input_tokens
        units.append((RequestSpec(f"t{i:05d}", (Message("user", text),), n, row.output_tokens),))
    stats = _stats(config, fmt, len(rows), sel, counter.exact, inexact)
    return Workload(
        config, tuple(units), counter.exact and not inexact, arrivals=sel.arrivals, trace=stats
    )


def _stats(
    config: TraceConfig, fmt: str, n_rows: int, sel: Selection, exact: bool, inexact: int
) -> TraceStats:
    sent, uncut = sharing(sel.rows), sharing(sel.original)
    return TraceStats(
        trace=Path(config.path).name, format=fmt, rows_in_file=n_rows, start=config.start,
        speed=config.speed, requests=len(sel.rows), scanned=sel.scanned,
        overlong=config.overlong, max_input_len=config.max_input_len,
        max_output_len=config.max_output_len, cut=sel.cut, skipped=sel.skipped,
        span_s=sel.arrivals[-1], input_tokens=sent.prompt_tokens,
        output_tokens=sum(r.output_tokens for r in sel.rows), reused_tokens=sent.reused_tokens,
        reuse=sent.reuse, reuse_uncut=uncut.reuse, blocks=sent.blocks,
        unique_blocks=sent.unique_blocks, exact_prompts=exact, inexact_prompts=inexact,
    )  # fmt: skip


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--trace`` flags, on ``p`` (``bench.cli`` adds them to ``tandem bench``)."""
    tr = p.add_argument_group(
        "trace replay (a workload of a public trace's requests: their arrival times, lengths "
        "and, for Mooncake, prefix sharing; --num-requests caps it, --rate replaces its times)"
    )
    tr.add_argument(
        "--trace",
        action="append",
        type=Path,
        default=[],
        metavar="PATH",
        help="Mooncake JSON lines (timestamp, input_length, output_length, hash_ids) or Azure "
        "LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens); repeatable; without "
        "--workload only the trace runs",
    )
    tr.add_argument(
        "--trace-format",
        choices=("auto", *FORMATS),
        default="auto",
        help="auto: from the file's first line",
    )
    tr.add_argument(
        "--trace-speed",
        type=float,
        default=1.0,
        metavar="X",
        help="divides the trace's times: 2.0 = arrivals twice as fast",
    )
    tr.add_argument(
        "--trace-start",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="replay from this many seconds after the trace's first request",
    )
    tr.add_argument(
        "--max-input-len",
        type=int,
        default=None,
        metavar="N",
        help="trace prompts' cap in tokens (content: a chat template adds its own; leave room "
        "for the outputs in the model's context): see --trace-overlong",
    )
    tr.add_argument(
        "--max-output-len", type=int, default=None, metavar="N", help="longer outputs are cut"
    )
    tr.add_argument(
        "--trace-overlong",
        choices=OVERLONG,
        default="cut",
        help="prompts over --max-input-len: cut to their first tokens (leading blocks, so "
        "sharing stays) or skip them (they do not count toward --num-requests)",
    )


def trace_config(args: argparse.Namespace, path: Path) -> TraceConfig:
    """The ``TraceConfig`` of ``path`` under the flags of ``add_trace_arguments`` (and
    ``--num-requests``, ``--seed``)."""
    return TraceConfig(
        str(path), args.num_requests, args.seed, args.trace_format, args.trace_start,
        args.trace_speed, args.max_input_len, args.max_output_len, args.trace_overlong,
    )  # fmt: skip
