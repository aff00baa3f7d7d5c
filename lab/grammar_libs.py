"""llguidance against xgrammar on the bundled model's tokenizer: the measurement behind the
choice of grammar library (engine/structured.py uses llguidance).

Both follow the same JSON document token by token under the same schema, ``--batch`` matchers
at a time, as the engine would: per step, fill every matcher's bitmask (llguidance in parallel
with ``LLExecutor``, as the engine does; xgrammar one matcher after the other, as its Python API
offers), then consume the token. Also timed: building the tokenizer side once, and compiling a
schema (xgrammar caches compiled grammars; the number is its first, uncached compile).

    pip install xgrammar==0.2.8   # not a Tandem dependency; it pulls triton and transformers
    python -m lab.grammar_libs

Writes ``grammar_libs_cpu.{md,json}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from engine.bundled import DEFAULT_DIR
from engine.grammar import JSON_OPTIONS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOC = {
    "name": "Alice Smith",
    "age": 34,
    "email": "alice@example.com",
    "tags": ["engineer", "hiker", "chess player"],
    "address": {"city": "Paris", "zip": "75001"},
}


def allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    return bool(np.unpackbits(mask[row].numpy().view(np.uint8), bitorder="little")[token])


def follow(
    ids: list[int], fill: Callable[[], None], consume: Callable[[int], None], check: Callable
) -> tuple[list[float], list[float]]:
    fills, consumes = [], []
    for t in ids:
        t0 = time.perf_counter()
        fill()
        fills.append(time.perf_counter() - t0)
        assert check(t), f"token {t} masked out"
        t0 = time.perf_counter()
        consume(t)
        consumes.append(time.perf_counter() - t0)
    return fills, consumes


def llguidance_run(tok: Tokenizer, vocab: int, ids: list[int], batch: int) -> dict:
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=2)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema({**SCHEMA, "x-guidance": JSON_OPTIONS})
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    compile_s = (time.perf_counter() - t0) / batch
    executor = llguidance.LLExecutor()
    mask = lt.allocate_token_bitmask(batch, vocab)
    rows = [(m, i) for i, m in enumerate(matchers)]

    def consume(t: int) -> None:
        for m in matchers:
            assert m.consume_token(t)

    fills, consumes = follow(
        ids,
        lambda: lt.fill_next_token_bitmask_par(executor, rows, mask),
        consume,
        lambda t: allowed(mask, 0, t),
    )
    return summary("llguidance 1.9.1", setup, compile_s, fills, consumes)


def xgrammar_run(tok: Tokenizer, vocab: int, ids: list[int], batch: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgr.allocate_token_bitmask(batch, vocab)

    def fill() -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def consume(t: int) -> None:
        for m in matchers:
            assert m.accept_token(t)

    fills, consumes = follow(ids, fill, consume, lambda t: allowed(mask, 0, t))
    return summary("xgrammar 0.2.8", setup, compile_s, fills, consumes)


def summary(name: str, setup: float, compile_s: float, fills: list, consumes: list) -> dict:
    return {
        "library": name,
        "tokenizer_setup_s": setup,
        "compile_ms": compile_s * 1000,
        "fill_ms_p50": statistics.median(fills) * 1000,
        "fill_ms_mean": statistics.mean(fills) * 1000,
        "fill_ms_max": max(fills) * 1000,
        "consume_ms_mean": statistics.mean(consumes) * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    tok = Tokenizer.from_file(str(DEFAULT_DIR / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    text = json.dumps(DOC)  # the ", " and ": " layout the engine generates
    ids = tok.encode(text, add_special_tokens=False).ids
    rows = [llguidance_run(tok, vocab, ids, args.batch)]
    try:
        rows.append(xgrammar_run(tok, vocab, ids, args.batch))
    except ImportError as e:
        print(f"xgrammar not measured: {e}", file=sys.stderr)
    cols = list(rows[0])
    lines = [
        f"# Grammar libraries, batch {args.batch}, {len(ids)}-token JSON document",
        "",
        f"- date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}",
        "- command: `python -m lab.grammar_libs`",
        f"- tokenizer: SmolLM2-135M-Instruct ({vocab} tokens); torch threads "
        f"{torch.get_num_threads()}",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    text_md = "\n".join(lines) + "\n"
    print(text_md)
    out = Path(args.out)
    (out / "grammar_libs_cpu.md").write_text(text_md)
    (out / "grammar_libs_cpu.json").write_text(json.dumps(rows, indent=1))
    return 0


def _fmt(v: object) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
