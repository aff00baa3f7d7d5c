"""Multi-LoRA decode throughput: requests spread over many adapters against base-only.

One engine (``enable_lora``, ``--max-loras`` slots) runs the same ``--requests`` prompts three
ways, greedy, exactly ``--output`` tokens each:

* ``base``: no adapter (the reference; CUDA graphs apply unless ``--enforce-eager``);
* ``batched``: request i uses adapter i % ``--adapters``, all adapters in one batch (the
  segmented LoRA kernel, ``kernels/triton_lora.py``), its decode steps replayed from the LoRA
  variant of the decode CUDA graphs (``engine/cuda_graphs.py``);
* ``batched-eager``: the same with the graphs set aside (each kernel launched from Python);
* ``one-at-a-time``: ``batched`` with the scheduler held to one adapter per step (what an
  engine without batched LoRA does: adapters take turns).

Adapters are random PEFT folders (rank ``--rank`` on ``--targets``) written under
``--adapter-dir`` (default: a temporary folder, removed at the end; ``--out`` gets only the
results).
Decode throughput is the output tokens generated after every request has its first token,
over that time; the table gives each run's share of base and how many of its steps replayed a
graph. On CUDA a second table times one replay of the captured graph of ``--requests`` rows,
base variant against LoRA variant (every row with an adapter, spread over the adapters), and
the LoRA kernels of every layer alone (captured in a graph of their own): fused, as the model
runs them (one shrink and one expand per input: q/k/v and gate/up share theirs), and one
projection at a time.

    SHAPE=llama-3.1-8b bash bench/device/run.sh bench lab.lora --model /tmp/models/llama-3.1-8b \
        --load-format dummy --out "$OUT"
    python -m lab.lora --requests 8 --adapters 4 --output 8   # CPU smoke run, bundled model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.lora_adapters import write_adapter

DEFAULT_MODEL = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(engine: LLMEngine, prompts: list[list[int]], loras: list[str | None], output: int) -> dict:
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    graphs = engine.runner.graphs
    replayed = graphs.runs if graphs is not None else 0
    for i, (p, name) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params, lora=name)
    start = time.perf_counter()
    firsts: set[str] = set()
    all_first = None
    tokens_after = 0
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        for o in outs:
            if o.request_id not in firsts:
                firsts.add(o.request_id)
                continue
            if all_first is not None:
                tokens_after += len(o.new_token_ids)
        if all_first is None and len(firsts) == len(prompts):
            all_first = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    end = time.perf_counter()
    decode_s = end - (all_first or end)
    return {
        "seconds": end - start,
        "steps": steps,
        "graph_steps": (graphs.runs - replayed) if graphs is not None else 0,
        "decode_seconds": decode_s,
        "decode_tokens": tokens_after,
        "decode_tok_s": tokens_after / decode_s if decode_s > 0 else 0.0,
    }


def replay_times(engine: LLMEngine, names: list[str], rows: int, context: int) -> dict:
    """Milliseconds of one replay of the decode graph for ``rows`` rows at ``context`` tokens
    each: the base variant, and the LoRA variant with row i on adapter i % len(names)."""
    from engine.cuda_graphs import DecodeBatch

    runner = engine.runner
    graphs, lora = runner.graphs, runner.lora
    assert graphs is not None and lora is not None
    size = graphs.padded_size(rows)
    if size is None:
        return {}
    bs = runner.config.block_size
    per_seq = context // bs + 1
    if rows * per_seq > runner.num_blocks:
        return {}
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(rows)]
    batch = DecodeBatch()
    for table in tables:
        batch.add([1], context, table, bs)
    token_slots = lora.token_slots([names[i % len(names)] for i in range(rows)], names)
    out = {"rows": rows, "size": size}
    for key, slots in (("base_ms", None), ("lora_ms", token_slots)):
        graphs.run(batch, slots)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for _ in range(reps):
            graphs.replay(size, slots is not None)
        end.record()
        end.synchronize()
        out[key] = start.elapsed_time(end) / reps
    return out


def lora_kernel_times(engine: LLMEngine, names: list[str], rows: int) -> dict:
    """Milliseconds of the LoRA kernels of every layer for ``rows`` rows (row i on adapter
    i % len(names)), captured in a CUDA graph and replayed: ``fused_ms`` as the model calls
    them (``LoRABatch.add_parts``), ``split_ms`` one projection at a time (``LoRABatch.add``)."""
    from engine.lora import LORA_GROUPS

    lora = engine.runner.lora
    assert lora is not None
    dev = lora.device
    adapters = [names[i % len(names)] for i in range(rows)]
    batch = lora.batch(adapters, lora.prepare(set(names)))
    assert batch is not None
    g = torch.Generator(device=dev).manual_seed(0)
    io = []
    for group in LORA_GROUPS:
        parts = tuple((m, lora.b[m].shape[2]) for m in group)
        fan_in = lora.a[group[0]].shape[3]
        x = torch.randn(rows, fan_in, generator=g, device=dev).to(lora.dtype)
        y = torch.zeros(rows, sum(w for _, w in parts), device=dev, dtype=lora.dtype)
        io.append((parts, x, y))
    layers = lora.model.num_layers

    def fused() -> None:
        for layer in range(layers):
            for parts, x, y in io:
                batch.add_parts(layer, parts, y, x)

    def split() -> None:
        for layer in range(layers):
            for parts, x, y in io:
                lo = 0
                for m, w in parts:
                    batch.add(layer, m, y[:, lo : lo + w], x)
                    lo += w

    out = {"rows": rows, "layers": layers}
    for key, fn in (("fused_ms", fused), ("split_ms", split)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        out[key] = start.elapsed_time(end) / reps
        del graph
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--load-format", default="safetensors", choices=("safetensors", "dummy"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", nargs="+", default=list(ALL), choices=ALL)
    ap.add_argument("--input", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=128, help="output tokens per request")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for base either")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each kind (best kept)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    ap.add_argument(
        "--adapter-dir", type=Path, default=None,
        help="where the adapters are written (default: a temporary folder, removed at the end)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    temp = args.adapter_dir is None
    adapter_dir = Path(tempfile.mkdtemp(prefix="lora_adapters_")) if temp else args.adapter_dir
    try:
        return _main(args, adapter_dir)
    finally:
        if temp:
            shutil.rmtree(adapter_dir, ignore_errors=True)


def _main(args: argparse.Namespace, adapter_dir: Path) -> int:
    config = EngineConfig(
        model_dir=str(args.model), load_format=args.load_format, enable_lora=True,
        max_loras=args.adapters, max_lora_rank=args.rank, enforce_eager=args.enforce_eager,
        max_num_seqs=max(args.requests, 1), max_num_batched_tokens=max(2048, args.input),
    )  # fmt: skip
    engine = LLMEngine(config)
    names = [f"lora{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        path = write_adapter(adapter_dir / name, engine, args.rank, args.targets, i)
        engine.add_lora(name, str(path))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab - 100, (args.input,), generator=g).tolist()]
    prompts = [[(t + i) % vocab for t in prompts[0]] for i in range(args.requests)]
    spread = [names[i % len(names)] for i in range(args.requests)]
    run(engine, prompts[:2], [None, names[0]], 4)  # warm-up (kernels compile)
    kinds = {"base": [None] * args.requests, "batched": spread, "batched-eager": spread,
             "one-at-a-time": spread}  # fmt: skip
    graphs = engine.runner.graphs
    if graphs is None:
        del kinds["batched-eager"]  # the same as batched
    results: dict[str, dict] = {}
    for kind, loras in kinds.items():
        engine.scheduler.max_loras = 1 if kind == "one-at-a-time" else args.adapters
        engine.runner.graphs = None if kind == "batched-eager" else graphs
        runs = [run(engine, prompts, loras, args.output) for _ in range(args.repeats)]
        results[kind] = max(runs, key=lambda r: r["decode_tok_s"])
    engine.runner.graphs = graphs
    replay = replay_times(engine, names, args.requests, args.input) if graphs else {}
    if replay:
        replay["kernels"] = lora_kernel_times(engine, names, args.requests)
    base = results["base"]["decode_tok_s"] or 1.0
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    lines = [
        f"multi-LoRA decode, {args.requests} requests over {args.adapters} adapters "
        f"(rank {args.rank}, {'/'.join(t.removesuffix('_proj') for t in args.targets)}), "
        f"{args.input} in / {args.output} out, {args.model.name}, {device}",
        "",
        "| run | decode tok/s | share of base | steps | graph steps | total s |",
        "|---|---|---|---|---|---|",
    ]
    for kind, r in results.items():
        lines.append(
            f"| {kind} | {r['decode_tok_s']:.0f} | {r['decode_tok_s'] / base:.2f} | "
            f"{r['steps']} | {r['graph_steps']} | {r['seconds']:.2f} |"
        )
    if replay:
        lines += [
            "",
            f"one graph replay, {replay['rows']} rows (captured size {replay['size']}):",
            "",
            "| variant | ms | vs base |",
            "|---|---|---|",
            f"| base | {replay['base_ms']:.3f} | 1.00 |",
            f"| LoRA, {len(names)} adapters | {replay['lora_ms']:.3f} | "
            f"{replay['lora_ms'] / replay['base_ms']:.2f} |",
        ]
        k = replay["kernels"]
        lines += [
            "",
            f"LoRA kernels alone, {k['rows']} rows, all {k['layers']} layers (one graph):",
            "",
            "| kernels | ms | ms per layer |",
            "|---|---|---|",
            f"| fused (q/k/v, gate/up share a shrink and an expand) | {k['fused_ms']:.3f} | "
            f"{k['fused_ms'] / k['layers']:.4f} |",
            f"| one projection at a time | {k['split_ms']:.3f} | "
            f"{k['split_ms'] / k['layers']:.4f} |",
        ]
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "device": device,
              "command": " ".join(sys.argv), "results": results, "replay": replay}  # fmt: skip
    (args.out / "lora.json").write_text(json.dumps(record, indent=2))
    (args.out / "lora.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
