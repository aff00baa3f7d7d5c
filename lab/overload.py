"""Issue 18's overload scenario, repeated: a stack as ``make serve`` builds it (etcd, router,
gateway, one prefill and one decode worker, gRPC KV transport, default admission bounds) takes
bursts of concurrent streaming completions (160 of 469 prompt tokens, 16 out, greedy); for each
burst, what was served in full, refused, broken, the 429 latency (p90, max) and each process's
CPU seconds during the burst. The slow test ``tests/stack/test_e2e_overload.py -k scenario`` asserts
one burst (two when the first misses); this shows how bursts vary on one stack and across
stacks, and what a setting changes (``--worker-nice``; environment variables such as
``TANDEM_REFUSAL_MEMORY=0`` or ``TANDEM_TOKENIZER_THREADS=40`` reach the services).

    python -m lab.overload --stacks 3 --bursts 2
    TANDEM_REFUSAL_MEMORY=0 python -m lab.overload --stacks 3 --bursts 2 --out /tmp/o

Prints a table; ``--out DIR`` also writes ``overload.json`` there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

from engine.bundled import DEFAULT_DIR, convert
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack.test_e2e_overload import SCENARIO_PROMPT, SCENARIO_STREAMS, overload_lean, p90


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def burst(stack: Stack, streams: int, max_tokens: int) -> dict:
    pids = {name: child.pid for name, child in stack.children.items()}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    url = f"{stack.url}/v1/completions"
    outs = asyncio.run(overload_lean(url, streams, SCENARIO_PROMPT, max_tokens))
    refused = [o.seconds for o in outs if o.status == 429]
    served = [o for o in outs if o.status == 200]
    return {
        "served": len(served),
        "refused": len(refused),
        "other": sum(o.status not in (200, 429) for o in outs),
        "broken": sum(bool(o.errors) or not o.done for o in served),
        "no_retry_after": sum("retry-after" not in o.headers for o in outs if o.status == 429),
        "p90_429_s": round(p90(refused), 3) if refused else None,
        "max_429_s": round(max(refused), 3) if refused else None,
        "cpu_s": {n: round(cpu_seconds(pid) - before[n], 2) for n, pid in pids.items()},
        "load": Path("/proc/loadavg").read_text().split()[0],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stacks", type=int, default=1, help="fresh stacks, one after the other")
    p.add_argument("--bursts", type=int, default=2, help="bursts per stack, 2 s apart")
    p.add_argument("--streams", type=int, default=SCENARIO_STREAMS)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--worker-nice", type=int, help="default: the stack's (as tandem serve)")
    p.add_argument("--out", type=Path, help="also write overload.json here")
    args = p.parse_args(argv)
    rows = []
    print(f"{'stack':>5} {'burst':>5} {'served':>6} {'429':>4} {'other':>5} {'broken':>6} "
          f"{'p90 429':>8} {'max 429':>8} {'load':>5}  cpu s (gateway/router/decode)")  # fmt: skip
    for s in range(args.stacks):
        with tempfile.TemporaryDirectory() as run_dir:
            config = StackConfig(
                model_dir=str(convert(DEFAULT_DIR)), run_dir=run_dir, port=free_port(),
                num_prefill=1, num_decode=1, kv_transport="grpc",
            )  # fmt: skip
            if args.worker_nice is not None:
                config = dataclasses.replace(config, worker_nice=args.worker_nice)
            with Stack(config) as stack:
                for b in range(args.bursts):
                    if b:
                        time.sleep(2)
                    r = {"stack": s, "burst": b, **burst(stack, args.streams, args.max_tokens)}
                    rows.append(r)
                    cpu = r["cpu_s"]
                    print(f"{s:>5} {b:>5} {r['served']:>6} {r['refused']:>4} {r['other']:>5} "
                          f"{r['broken']:>6} {r['p90_429_s']!s:>8} {r['max_429_s']!s:>8} "
                          f"{r['load']:>5}  {cpu['gateway']}/{cpu['router']}/{cpu['decode-0']}",
                          flush=True)  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "overload.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
