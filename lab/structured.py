"""Cost of grammar-constrained decoding: time per output token (TPOT) of a batch of requests
constrained by a JSON schema against the same batch unconstrained, side by side in one process.

Both runs sample at temperature 1.0 from ``--batch`` distinct prompts, ``--max-tokens`` tokens
each (the schema asks for a long array, so no constrained request ends early; unconstrained ones
ignore EOS). TPOT is the median wall time of the decode steps that run the whole batch (steps
that prefill are left out). The runs alternate, ``--repeats`` times each, on one warm engine
with the prefix cache off. The grammar columns say how long the helper thread filled the token
bitmasks per step, and how long the step waited for them after its forward pass (the rest was
hidden behind it).

    python -m lab.structured                      # CPU, the bundled model (its real weights)
    SHAPE=llama-3.1-8b bash bench/device/run.sh bench lab.structured --device cuda \
        --model-dir /tmp/models/llama-3.1-8b --load-format dummy --out $OUT   # a GPU host

Results go to ``--out/structured_<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.bundled import DEFAULT_DIR
from engine.grammar import GrammarSpec
from engine.step_stats import StepStats

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# Long enough that no request completes its JSON before --max-tokens.
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": ITEM, "minItems": 200}},
    "required": ["people"],
    "additionalProperties": False,
}
TOPICS = (
    "sailors", "bakers", "chess players", "painters", "nurses", "pilots", "farmers", "poets",
    "divers", "judges", "miners", "chemists", "drummers", "tailors", "monks", "rangers",
)  # fmt: skip


@dataclass
class Run:
    mode: str  # "plain" or "json"
    repeat: int
    decode_steps: int
    step_ms_median: float
    step_ms_mean: float
    fill_ms_per_step: float = 0.0
    wait_ms_per_step: float = 0.0
    tokens: int = 0
    wall_s: float = 0.0
    all_full_length: bool = True  # every request ran to max_tokens


@dataclass
class Result:
    device: str
    model: str
    batch: int
    max_tokens: int
    runs: list[Run] = field(default_factory=list)
    sampler_ms: dict[str, float] = field(default_factory=dict)  # "plain" / "masked"

    def median(self, mode: str, key: str = "step_ms_median") -> float:
        return statistics.median(getattr(r, key) for r in self.runs if r.mode == mode)

    @property
    def overhead(self) -> float:
        return self.median("json") / self.median("plain") - 1.0


def prompts(engine: LLMEngine, batch: int) -> list[list[int]]:
    tok = engine.tokenizer
    asks = [f"List people who are {TOPICS[i % len(TOPICS)]} ({i}) as JSON." for i in range(batch)]
    if tok.chat_template:
        return [tok.encode_chat([{"role": "user", "content": a}]) for a in asks]
    return [tok.encode(a) for a in asks]


def run_once(
    engine: LLMEngine, ids: list[list[int]], mode: str, repeat: int, max_tokens: int
) -> Run:
    grammar = GrammarSpec.json_schema(SCHEMA) if mode == "json" else None
    steps: list[StepStats] = []
    engine.on_step = steps.append
    before = (engine.grammar.stats.fills, engine.grammar.stats.fill_seconds,
              engine.grammar.stats.wait_seconds)  # fmt: skip
    t0 = time.perf_counter()
    for i, prompt in enumerate(ids):
        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=1000 * repeat + i, ignore_eos=True,
            grammar=grammar,
        )  # fmt: skip
        engine.add_request(f"{mode}-{repeat}-{i}", prompt, params)
    tokens = 0
    finished = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                finished.append(out)
    wall = time.perf_counter() - t0
    engine.on_step = None
    full = [s.seconds * 1000 for s in steps if s.phase == "decode" and s.decode_seqs == len(ids)]
    st = engine.grammar.stats
    n = max(st.fills - before[0], 1)
    fill_s, wait_s = st.fill_seconds - before[1], st.wait_seconds - before[2]
    return Run(
        mode, repeat, len(full), statistics.median(full), statistics.mean(full),
        fill_s * 1000 / n, wait_s * 1000 / n, tokens, wall,
        all(o.finish_reason == "length" for o in finished),
    )  # fmt: skip


def measure(args: argparse.Namespace) -> Result:
    model_dir = Path(args.model_dir).expanduser()
    engine = LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            device=args.device,
            load_format=args.load_format,
            enable_prefix_caching=False,
            max_num_seqs=max(args.batch, 16),
            max_num_batched_tokens=max(512, args.batch * 64),
            # On CUDA the pool is what the memory share leaves; sequences stay short.
            kv_cache_bytes=None if args.device.startswith("cuda") else args.kv_cache_mib * 1024**2,
            max_model_len=4096,
        )
    )
    ids = prompts(engine, args.batch)
    device = str(engine.runner.device)
    result = Result(device, str(model_dir), args.batch, args.max_tokens)
    run_once(engine, ids, "json", -1, 4)  # warm-up: grammar tokenizer, kernels, graphs
    run_once(engine, ids, "plain", -1, 4)
    result.sampler_ms = sampler_cost(engine, args.batch)
    for r in range(args.repeats):
        for mode in ("plain", "json") if r % 2 == 0 else ("json", "plain"):
            run = run_once(engine, ids, mode, r, args.max_tokens)
            result.runs.append(run)
            print(f"  {mode:5} repeat {r}: step {run.step_ms_median:.2f} ms (median of "
                  f"{run.decode_steps}), fill {run.fill_ms_per_step:.3f} ms, wait "
                  f"{run.wait_ms_per_step:.3f} ms", flush=True)  # fmt: skip
    return result


def sampler_cost(engine: LLMEngine, batch: int, iters: int = 30) -> dict[str, float]:
    """Median ms of one sampler call on ``batch`` rows of random logits, unconstrained and with
    every row masked (the mask application the step pays on its critical path)."""
    from engine.sampler import Sampler, SamplingRow

    dev, vocab = engine.runner.device, engine.model_config.vocab_size
    logits = torch.randn(batch, vocab, device=dev, dtype=engine.runner.dtype)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, device=dev)
    out = {}
    for name, guided in (("plain", False), ("masked", True)):
        rows = [SamplingRow(SamplingParams(temperature=1.0), None, [], [], guided)] * batch
        Sampler()(logits, rows, mask if guided else None)  # warm-up
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            Sampler()(logits, rows, mask if guided else None)
            times.append((time.perf_counter() - t0) * 1000)
        out[name] = statistics.median(times)
    return out


def report(result: Result, args: argparse.Namespace) -> str:
    lines = [
        f"# Constrained decoding cost, {result.device}",
        "",
        f"- date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}",
        f"- command: `python -m lab.structured {shlex.join(sys.argv[1:])}`",
        f"- machine: {machine(result.device)}",
        f"- model: `{result.model}` ({args.load_format} weights), batch {result.batch}, "
        f"{result.max_tokens} tokens per request, temperature 1.0",
        "- schema: an object holding an array of at least 200 {name, age, city} objects (no "
        "request completes it; unconstrained requests ignore EOS)",
        "",
        "| run | mode | decode steps | step ms (median) | step ms (mean) | mask fill ms/step "
        "| wait for mask ms/step | output tokens |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.runs:
        lines.append(
            f"| {r.repeat} | {r.mode} | {r.decode_steps} | {r.step_ms_median:.2f} | "
            f"{r.step_ms_mean:.2f} | {r.fill_ms_per_step:.3f} | {r.wait_ms_per_step:.3f} | "
            f"{r.tokens} |"
        )
    plain, constrained = result.median("plain"), result.median("json")
    critical = result.median("json", "wait_ms_per_step") + max(
        result.sampler_ms["masked"] - result.sampler_ms["plain"], 0.0
    )
    verdict = "met" if result.overhead <= 0.10 else "NOT met"
    lines += [
        "",
        f"TPOT (median over runs of the per-run median step): unconstrained {plain:.2f} ms, "
        f"constrained {constrained:.2f} ms: **{100 * result.overhead:+.1f}%** "
        f"(goal <= +10%: {verdict}).",
        f"Mask fill {result.median('json', 'fill_ms_per_step'):.3f} ms per step on the helper "
        f"thread, of which the step waited {result.median('json', 'wait_ms_per_step'):.3f} ms "
        "after its forward pass.",
        f"Sampler alone on {result.batch} rows: {result.sampler_ms['plain']:.2f} ms "
        f"unconstrained, {result.sampler_ms['masked']:.2f} ms with every row masked: the "
        f"grammar's work on the step's critical path (wait + mask) is {critical:.2f} ms, "
        f"{100 * critical / plain:.2f}% of the unconstrained TPOT.",
        "",
    ]
    return "\n".join(lines)


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    from bench.report import cpu_model

    return f"{cpu_model()}, torch {torch.__version__} (threads: {torch.get_num_threads()})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEFAULT_DIR))
    p.add_argument("--load-format", default="safetensors", choices=("safetensors", "dummy"))
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool on CPU")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args)
    text = report(result, args)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "cuda" if result.device.startswith("cuda") else "cpu"
    (out / f"structured_{name}.md").write_text(text)
    payload = {**asdict(result), "overhead": result.overhead, "argv": sys.argv[1:]}
    (out / f"structured_{name}.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
