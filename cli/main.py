"""The ``tandem`` command: ``serve`` (the local stack), ``bench`` (load generator), one
subcommand per service, ``demo``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.bundled import DEFAULT_DIR
from services.launcher.options import add_worker_options, worker_overrides
from services.router.policy import POLICIES

SERVICES = ("gateway", "router", "prefill", "decode")


def _demo(args: argparse.Namespace) -> int:
    """Stream a chat reply from the model, token by token, in this process."""
    from engine import LLM, SamplingParams

    llm = LLM(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    prompts = args.prompt or ["What is the capital of France?", "Write a haiku about the sea."]
    for prompt in prompts:
        print(f"\n>>> {prompt}")
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        for out in llm.stream(ids, params):
            print(out.new_text, end="", flush=True)
        print(f"\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Start etcd, router, prefill, decode and gateway on loopback until Ctrl-C / SIGTERM."""
    import signal
    import tempfile
    import time

    from engine.bundled import convert
    from services.launcher.stack import Stack, StackConfig
    from services.launcher.supervisor import RestartPolicy

    specs = args.model or [str(convert(DEFAULT_DIR))]
    first, *extra = specs
    if "=" in first:
        raise SystemExit("error: the first --model is served under its folder's name (no NAME=)")
    model = Path(first).expanduser()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="tandem-run-")
    common = dict(model_dir=str(model), run_dir=str(run_dir), port=args.port)
    common["extra_models"] = tuple(extra)
    common.update(worker_overrides(args))
    common["api_keys"] = tuple(args.api_key or ())
    common["num_routers"] = args.routers
    common["router_policy"] = args.router_policy or ""
    if args.colocated:
        config = StackConfig.colocated(args.colocated, **common)
    else:
        if args.decode_only_threshold is not None:
            common["decode_only_threshold"] = args.decode_only_threshold
        if args.disagg_mode is not None:
            common["disagg_mode"] = args.disagg_mode
        common["switch_roles"] = args.switch_roles
        config = StackConfig(
            num_prefill=args.prefill_workers, num_decode=args.decode_workers, **common
        )
    stack = Stack(config)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        stack.start()
        print(f"etcd      {stack.etcd.endpoint}")
        for child in stack.children.values():
            metrics = f"metrics: :{child.metrics_port}  " if child.metrics_port else ""
            print(f"{child.name:<9} {child.address:<22} {metrics}log: {child.log_path}")
        print(f"\nOpenAI endpoint: {stack.url}/v1  (models: {', '.join(config.models)})")
        print(f"topology: {config.topology}")
        for model, adapters in stack.adapters.items():
            if adapters:
                print(f"LoRA on {model}: {', '.join(a.partition('=')[0] for a in adapters)}")
        if stack.kv_note:
            print(stack.kv_note)
        for name, placement in config.placements().items():
            if placement.device is not None:
                gpus = ",".join(placement.devices)
                print(f"{name:<9} GPU {gpus} (share {placement.utilization})")
        if stack.scrape_targets():
            prom = stack.write_prometheus_config()
            print(f"metrics: prometheus --config.file={prom} "
                  f"--storage.tsdb.path={stack.run_dir / 'prometheus'} "
                  "--web.listen-address=127.0.0.1:9090")  # fmt: skip
        print("Ctrl-C stops everything (gateway, workers, routers, etcd, in that order).")
        print(f"a child that exits is restarted (up to {args.max_restarts} times within "
              f"{args.restart_window:.0f} s)", flush=True)  # fmt: skip
        policy = RestartPolicy(max_crashes=args.max_restarts + 1, window=args.restart_window)
        supervisor = stack.supervisor(policy, say=lambda line: print(line, flush=True))
        while not stopping:
            supervisor.poll()
            if "gateway" in supervisor.given_up:
                print("the gateway cannot be kept running; stopping the stack", flush=True)
                return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping...", flush=True)
        stack.stop()
    return 0


def _role(args: argparse.Namespace) -> int:
    """Write (or with ``auto`` delete) a switchable worker's role order in etcd."""
    import asyncio

    from libkv.cluster.roles import RoleOrder, RoleOrders

    async def run() -> None:
        orders = RoleOrders(args.etcd.split(","))
        try:
            if args.role == "auto":
                await orders.delete(args.worker_id)
            else:
                await orders.put(args.worker_id, RoleOrder(args.role, "operator"))
        finally:
            await orders.close()

    asyncio.run(run())
    what = "left to the role balancer" if args.role == "auto" else f"told to serve {args.role}"
    print(f"{args.worker_id}: {what}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from bench.cli import run

    return run(args)


def _service(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        importlib.import_module(f"services.{module}.__main__").main(rest)
        return 0

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate from a model in-process (no services)")
    demo.add_argument("--model", type=Path, default=DEFAULT_DIR)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("prompt", nargs="*", help="user messages (default: two examples)")
    demo.set_defaults(func=_demo)
    serve = sub.add_parser("serve", help="run the whole stack on loopback (etcd + 4 services)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="model folder (repeatable: several base models behind one endpoint, each with its "
        "own workers; the served name is the folder's unless NAME= is given; default: the "
        "bundled SmolLM2)",
    )
    serve.add_argument("--run-dir", type=Path, default=None, help="logs and etcd data")
    serve.add_argument("--prefill-workers", type=int, default=1)
    serve.add_argument("--decode-workers", type=int, default=1)
    serve.add_argument(
        "--colocated",
        type=int,
        metavar="N",
        default=0,
        help="N workers that each do both phases (N decode workers, no prefill worker, every "
        "request decode-only); overrides --prefill-workers/--decode-workers",
    )
    serve.add_argument(
        "--decode-only-threshold",
        type=int,
        default=None,
        help="prompts whose uncached part is shorter skip the prefill pool: at a cold start, "
        "and always under --disagg-mode length (router default: 256)",
    )
    serve.add_argument(
        "--disagg-mode",
        choices=("slo", "length"),
        default=None,
        help="the routers' choice per prompt: slo (prefill pool or decode worker, whichever is "
        "predicted to meet the request's SLOs; the default) or length (--decode-only-threshold)",
    )
    serve.add_argument(
        "--max-restarts",
        type=int,
        default=4,
        help="restart a child that exits (worker, router, gateway, etcd) with exponential "
        "backoff at most this many times within --restart-window, then give up on it",
    )
    serve.add_argument(
        "--restart-window", type=float, default=60.0, help="seconds (see --max-restarts)"
    )
    serve.add_argument("--api-key", action="append", help="require this API key (repeatable)")
    serve.add_argument(
        "--routers", type=int, default=1, help="router replicas; the gateway spreads over them"
    )
    serve.add_argument(
        "--router-policy",
        choices=POLICIES,
        default=None,
        help="routing policy (router default: kv)",
    )
    serve.add_argument(
        "--switch-roles",
        action="store_true",
        help="workers switch between prefill and decode at run time (--switchable), as the "
        "first router's pool planner says (--balance-roles)",
    )
    add_worker_options(serve)
    serve.set_defaults(func=_serve)
    role = sub.add_parser(
        "role",
        help="switch a --switchable worker's role now, pinned until `tandem role WORKER auto`",
    )
    role.add_argument("worker_id")
    role.add_argument("role", choices=("prefill", "decode", "auto"))
    role.add_argument("--etcd", default="127.0.0.1:2379", help="etcd endpoints host:port[,...]")
    role.set_defaults(func=_role)
    from bench.cli import add_arguments as add_bench_arguments

    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible endpoint or local stacks (see --help)"
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    for name in SERVICES:
        svc = sub.add_parser(name, help=f"run one {name} (flags: tandem {name} --help)")
        svc.add_argument("rest", nargs=argparse.REMAINDER)
        svc.set_defaults(func=_service(name))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SERVICES:
        # `tandem decode --port 1`: everything after the name is the service's own flags
        # (argparse would take a leading flag for one of ours); `tandem decode -- ...` also works.
        argv = [argv[0], "--", *argv[1:]] if argv[1:2] != ["--"] else argv
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
