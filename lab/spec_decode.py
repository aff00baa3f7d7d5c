"""N-gram speculative decoding against plain decoding at batch 1, on repetitive workloads.

Two modes, one script:

- ``measure`` (default; CPU or GPU): the real model (the bundled SmolLM2-135M-Instruct unless
  ``--model``), greedy, one request at a time, on two workloads where the output repeats its
  input: *edit a code file* (the whole file back with a change) and *summarise with quotes*.
  Each workload runs ``--repeats`` times per mode, the modes interleaved; the table gives the
  median tokens/s of each, their ratio, whether the outputs are token-identical, and the
  acceptance: draft tokens kept / proposed, kept per draft, tokens per decode step, kept by
  draft position. It also writes each speculative run's per-step trace (drafted, kept).
- ``replay`` (GPU, random weights of a real shape, ``--shape llama-3.1-8b``): what the issue's
  GPU target needs where no real checkpoint of that size is at hand. A step that verifies
  ``d`` draft tokens is timed through the engine for every ``d`` (0 = a plain decode step, CUDA
  graph), then the traces of a ``measure`` run (``--trace``, e.g. the CPU one) are replayed:
  speculative time = sum of the timed steps of the trace, plain time = one decode step per
  token. This is a projection from measured step times, and says so in its output.

    python -m lab.spec_decode --out bench/results                         # CPU, real model
    python -m lab.spec_decode --mode replay --shape llama-3.1-8b \\
        --trace bench/results/spec_decode_cpu.json --out $OUT               # GPU

Writes ``spec_decode_<device>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.report import cpu_model
from engine import LLM, SamplingParams
from engine.bundled import DEFAULT_DIR

REPO = Path(__file__).resolve().parents[1]
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 5,
    "prompt_lookup_max": 5,
    "prompt_lookup_min": 2,
}
CODE_FILE = REPO / "libkv" / "hashing.py"
REPORT = """Water levels in the northern reservoir fell for the third month in a row, the regional
water board said on Monday. "We are at forty-one percent of capacity, which is the lowest
September figure since records began," said the board's director, Maria Lindqvist. The board
will ask households to cut their use by a tenth from October, and garden watering will be
banned between eight in the morning and eight in the evening. Farmers are exempt for now.
"Agriculture uses less than a fifth of the water we supply, and the harvest is not yet in,"
Lindqvist said. Engineers are also repairing leaks in the old pipes under the city centre,
which lose an estimated twelve million litres a day. "Every litre we save in the pipes is a
litre nobody has to save at home," said the chief engineer, Tomas Berg. The board expects
the reservoir to recover if autumn rainfall is normal, but warns that a dry winter would
mean stricter limits in the spring."""


def workloads(llm: LLM) -> dict[str, list[int]]:
    tok = llm.tokenizer
    code = CODE_FILE.read_text()
    edit = (
        "Here is a Python file. Rename the function `hash_block` to `block_hash` everywhere "
        "and output the whole file, unchanged otherwise.\n\n```python\n" + code + "```"
    )
    summary = (
        "Summarise this news report in a few sentences, quoting what the people in it said "
        "word for word.\n\n" + REPORT
    )
    return {
        "edit_code": tok.encode_chat([{"role": "user", "content": edit}]),
        "summarise_quotes": tok.encode_chat([{"role": "user", "content": summary}]),
    }


def run_once(llm: LLM, prompt: list[int], max_tokens: int) -> dict:
    """One greedy request alone: tokens, wall time, decode time (after the first token), and
    per decode step the drafted and emitted tokens."""
    eng = llm.engine
    before = eng.stats().spec
    rid = f"bench-{time.monotonic_ns()}"
    eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    trace: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    first = None
    final = None
    while eng.has_unfinished():
        drafted = eng.stats().spec.draft_tokens
        for out in eng.step():
            if first is None:
                first = time.perf_counter()
            else:
                trace.append((eng.stats().spec.draft_tokens - drafted, len(out.new_token_ids)))
            final = out
    end = time.perf_counter()
    assert final is not None and first is not None
    after = eng.stats().spec
    n = len(final.token_ids)
    return {
        "tokens": n,
        "token_ids": final.token_ids,
        "tokens_per_s": n / (end - t0),
        "decode_tokens_per_s": (n - 1) / (end - first) if n > 1 else 0.0,
        "trace": trace,
        "drafts": after.drafts - before.drafts,
        "draft_tokens": after.draft_tokens - before.draft_tokens,
        "accepted": after.accepted_tokens - before.accepted_tokens,
        "accepted_per_pos": [
            a - b for a, b in zip(after.accepted_per_pos, before.accepted_per_pos, strict=False)
        ],
    }


def spec_configs(args) -> dict[str, dict]:
    """The speculative configs to compare with plain decoding, by method."""
    out: dict[str, dict] = {}
    for method in args.methods.split(","):
        if method == "ngram":
            out[method] = SPEC
        elif method == "draft_model":
            draft = args.draft or str(draft_folder(args))
            out[method] = {
                "method": "draft_model",
                "model": draft,
                "num_speculative_tokens": args.draft_k,
            }
        else:
            raise SystemExit(f"--methods: unknown method {method!r} (ngram, draft_model)")
    return out


def draft_folder(args) -> Path:
    """Without --draft: the bundled model's layers --draft-layers, written once."""
    from bench.draft_model import parse_layers, truncate_model

    dst = Path(args.out) / ".drafts" / f"smol-{args.draft_layers.replace(',', '_')}"
    if not (dst / "model.safetensors").is_file():
        truncate_model(args.model, dst, parse_layers(args.draft_layers))
    return dst


def measure(args) -> dict:
    opts = dict(kv_cache_bytes=256 * 1024**2, max_num_batched_tokens=1024, seed=0)
    if args.device:
        opts["device"] = args.device
    base = LLM(args.model, **opts)
    configs = spec_configs(args)
    engines = {m: LLM(args.model, **opts, speculative_config=c) for m, c in configs.items()}
    rows = []
    for name, prompt in workloads(base).items():
        runs: dict[str, list[dict]] = {"base": [], **{m: [] for m in engines}}
        run_once(base, prompt, 8)  # warm-up (and CUDA graph capture is done at start)
        for llm in engines.values():
            run_once(llm, prompt, 8)
        for _ in range(args.repeats):  # the modes interleaved, so load drifts hit all alike
            runs["base"].append(run_once(base, prompt, args.max_tokens))
            for m, llm in engines.items():
                runs[m].append(run_once(llm, prompt, args.max_tokens))
        for m in engines:
            rows.append(summarise(name, m, len(prompt), runs["base"], runs[m]))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "trace"}), flush=True)
    return {"mode": "measure", "rows": rows, "speculative_configs": configs}


def summarise(name: str, method: str, prompt_len: int, base: list[dict], spec: list[dict]) -> dict:
    med = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in (("base", base),
           ("spec", spec))}  # fmt: skip
    dec = {m: statistics.median(r["decode_tokens_per_s"] for r in rs) for m, rs in (
           ("base", base), ("spec", spec))}  # fmt: skip
    s = spec[-1]
    exact = all(r["token_ids"] == base[0]["token_ids"] for r in spec)
    drafts = max(s["drafts"], 1)
    return {
        "workload": name,
        "method": method,
        "prompt_tokens": prompt_len,
        "output_tokens": s["tokens"],
        "base_tok_s": med["base"],
        "spec_tok_s": med["spec"],
        "speedup": med["spec"] / med["base"],
        "decode_speedup": dec["spec"] / dec["base"],
        "token_exact": exact,
        "acceptance": s["accepted"] / max(s["draft_tokens"], 1),
        "kept_per_draft": s["accepted"] / drafts,
        "tokens_per_step": (s["tokens"] - 1) / max(len(s["trace"]), 1),
        "accepted_per_pos": [round(a / drafts, 3) for a in s["accepted_per_pos"]],
        "trace": s["trace"],  # per decode step: (drafted, emitted)
    }


def replay(args) -> dict:
    """Time a decode step verifying d drafts (d = 0..k) at batch 1 on a random-weight shape, then
    replay the per-step traces of a measure run."""
    from lab.spec_replay import step_times

    trace_src = json.loads(Path(args.trace).read_text())
    k = SPEC["num_speculative_tokens"]
    times, graph_rows = step_times(args.shape, k, args.context, args.steps)
    rows = []
    for r in trace_src["rows"]:
        if r.get("method", "ngram") != "ngram":  # a draft model's cost is not in these times
            continue
        steps = r["trace"]  # per decode step of the measured run: (drafted, emitted)
        tokens = sum(e for _, e in steps)
        spec_ms = sum(times[d] for d, _ in steps)
        base_ms = tokens * times[0]
        rows.append(
            {
                "workload": r["workload"],
                "trace_from": trace_src.get("device", "?"),
                "decode_tokens": tokens,
                "steps": len(steps),
                "step_ms_plain": times[0],
                "step_ms_verify_k": times[k],
                "projected_speedup": base_ms / spec_ms,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    out = {"mode": "replay", "shape": args.shape, "step_ms": times, "rows": rows,
           "graph_rows_per_step": graph_rows}  # fmt: skip
    if args.draft_shape:
        out["draft"] = draft_projection(args, times)
    return out


def draft_projection(args, times: dict[int, float]) -> dict:
    """Draft-model steps timed on random weights (draft + verify of k tokens), and the speedup
    they would give at acceptance rates ``alpha`` (each draft token kept with probability
    ``alpha`` while the ones before it were): tokens per step (1 - a^(k+1)) / (1 - a)."""
    from lab.spec_replay import draft_step_time

    k = args.draft_k
    spec_ms = draft_step_time(args.shape, args.draft_shape, k, args.context, args.steps)
    rows = []
    for a in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9):
        per_step = (1 - a ** (k + 1)) / (1 - a)
        rows.append({"alpha": a, "tokens_per_step": per_step,
                     "projected_speedup": per_step * times[0] / spec_ms})  # fmt: skip
    return {"draft_shape": args.draft_shape, "k": k, "step_ms_draft_and_verify": spec_ms,
            "draft_ms": spec_ms - times.get(k, float("nan")), "rows": rows}  # fmt: skip


COLS = {
    "measure": [
        "workload", "method", "prompt_tokens", "output_tokens", "base_tok_s", "spec_tok_s",
        "speedup",
        "decode_speedup", "token_exact", "acceptance", "kept_per_draft", "tokens_per_step",
        "accepted_per_pos",
    ],
    "replay": [
        "workload", "trace_from", "decode_tokens", "steps", "step_ms_plain", "step_ms_verify_k",
        "projected_speedup",
    ],
}  # fmt: skip


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(
        lines + ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    )


def device_name(args) -> str:
    if torch.cuda.is_available() and args.device != "cpu":
        return torch.cuda.get_device_name()
    return f"cpu ({cpu_model()}, {torch.get_num_threads()} torch threads)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("measure", "replay"), default="measure")
    p.add_argument("--model", default=str(DEFAULT_DIR))
    p.add_argument("--methods", default="ngram", help="ngram, draft_model or both (comma)")
    p.add_argument(
        "--draft",
        default="",
        help="draft_model: the draft folder (default: "
        "the bundled model's --draft-layers, written under --out/.drafts)",
    )
    p.add_argument("--draft-layers", default="0-3,8-29", help="layers the default draft keeps")
    p.add_argument("--draft-k", type=int, default=3, help="draft_model: num_speculative_tokens")
    p.add_argument("--device", default="", help="cpu or cuda (default: the engine's choice)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: default)")
    p.add_argument("--shape", default="llama-3.1-8b", help="replay: engine.shapes name")
    p.add_argument(
        "--draft-shape",
        default="",
        help="replay: also time a draft model of "
        "this engine.shapes name (random weights) and project its speedup",
    )
    p.add_argument("--context", type=int, default=1024, help="replay: tokens in the KV cache")
    p.add_argument("--steps", type=int, default=40, help="replay: timed steps per draft length")
    p.add_argument("--trace", default=str(REPO / "bench/results/spec_decode_cpu.json"))
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--date", default=dt.date.today().isoformat())
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = measure(args) if args.mode == "measure" else replay(args)
    res.update(
        device=device_name(args),
        date=args.date,
        command="python -m lab.spec_decode " + shlex.join(sys.argv[1:] if argv is None else argv),
        torch=torch.__version__,
    )
    md = report(res)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    on_gpu = res["device"].startswith("cpu") is False
    name = (
        "spec_decode_"
        + ("cuda" if on_gpu else "cpu")
        + ("_replay" if args.mode == "replay" else "")
    )
    (args.out / f"{name}.md").write_text(md)
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))


def report(res: dict) -> str:
    head = [
        f"# Speculative decoding, batch 1 ({res['mode']})",
        "",
        f"- device: {res['device']}; torch {res['torch']}",
        f"- date: {res['date']}",
        f"- command: `{res['command']}`",
    ]
    if res["mode"] == "measure":
        for method, cfg in res["speculative_configs"].items():
            head.append(f"- {method}: `{json.dumps(cfg)}`; greedy")
    else:
        graph_rows = {d: round(r, 2) for d, r in res.get("graph_rows_per_step", {}).items()}
        head.append(
            f"- shape {res['shape']} (random weights); measured step times (ms) by drafts "
            f"verified: {json.dumps({d: round(t, 3) for d, t in res['step_ms'].items()})} "
            f"(rows per step replayed from CUDA graphs: {json.dumps(graph_rows)}); "
            "projection: one plain step per token against the measured trace's steps, each "
            "charged the time of a step verifying as many drafts as it had"
        )
    body = [*head, "", table(res["rows"], COLS[res["mode"]])]
    if "draft" in res:
        d = res["draft"]
        body += [
            "",
            f"Draft model {d['draft_shape']} (random weights), k={d['k']}: a step drafting and "
            f"verifying {d['k']} tokens took {d['step_ms_draft_and_verify']:.3f} ms (draft part "
            f"~{d['draft_ms']:.3f} ms), a plain step {res['step_ms'][0]:.3f} ms. Random weights "
            "keep no drafts, so the speedup below is projected at given acceptance rates, not "
            "measured:",
            "",
            table(d["rows"], ["alpha", "tokens_per_step", "projected_speedup"]),
        ]
    return "\n".join(body) + "\n"


if __name__ == "__main__":
    main()
