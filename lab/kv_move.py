"""Live KV migration against re-prefill: what it costs a running request to continue on another
decode worker, from the moment it leaves the first worker's batch to its next token there.

- move: the request leaves engine A's batch with its KV held (``hold_for_move``), its blocks
  reach engine B's pool, B joins it to its batch and samples the next token. ``--transport
  bytes`` (default): read out of A and written into B (the gRPC-stream transport's byte work,
  no network); ``--transport nixl``: B's NIXL agent READs them from A's (two agents over the
  two pools, as a decode worker taking over a draining one's requests does; both engines run
  in this process, so UCX copies within it);
  "transfer" is the block movement alone (median of 5 copies), "move" all of it;
- re-prefill: B takes the same request from its prompt plus the tokens already produced (what
  a migration does when the KV is lost) and computes all of it before the next token (another
  tenant, so B's prefix cache does not help).

    python -m lab.kv_move --model ~/.cache/tandem/models/SmolLM2-135M-Instruct
    python -m lab.kv_move --transport nixl

Prints a table; ``--out DIR`` also writes ``kv_move_<transport>.json`` there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.bundled import DEFAULT_DIR
from engine.handoff import FirstToken


def next_token(engine: LLMEngine, rid: str) -> None:
    while not any(o.request_id == rid for o in engine.step()):
        pass


Move = Callable[[list[int], list[int]], None]  # (B's blocks, A's blocks)
TRANSFER_REPEATS = 4  # "transfer ms": the median of the move's copy and this many more


def copy_bytes(a: LLMEngine, b: LLMEngine) -> Move:
    def move(dst: list[int], src: list[int]) -> None:
        b.handoff.write_blocks(dst, a.handoff.read_blocks(src))

    return move


def nixl_read(a: LLMEngine, b: LLMEngine, loop: asyncio.AbstractEventLoop) -> Move:
    """B's agent READs from A's, both over their whole pools (as workers register them)."""
    from libkv.transfer.nixl_agent import NixlEndpoint
    from libkv.transfer.pool import PoolStore

    def region(e: LLMEngine):
        return PoolStore(e.runner.kv_pool, e.runner.block_bytes, e).region

    async def start() -> tuple[NixlEndpoint, NixlEndpoint]:
        ea = await NixlEndpoint.start("bench-move-a", region(a))
        eb = await NixlEndpoint.start("bench-move-b", region(b))
        assert ea.info is not None
        await eb.connect(ea.info)
        for ep in (ea, eb):  # both progress UCX while a transfer runs, as workers' pumps do
            ep.start_pump(lambda peer, message: None, busy=lambda: True)
        return ea, eb

    ea, eb = loop.run_until_complete(start())

    def move(dst: list[int], src: list[int]) -> None:
        loop.run_until_complete(eb.transfer("READ", ea.name, dst, src, b"rel", 60.0))

    return move


def one(a: LLMEngine, b: LLMEngine, move: Move, prompt: list[int], produced: int, tag: str) -> dict:
    params = SamplingParams(max_tokens=produced + 8, temperature=0, ignore_eos=True)
    rid = f"run-{tag}"
    a.add_request(rid, prompt, params)
    outs = 0
    while outs < produced:
        outs += sum(o.request_id == rid for o in a.step())
    t0 = time.perf_counter()
    held = a.handoff.hold_for_move(rid)
    assert held is not None
    done = list(held.output_token_ids)
    tenant = f"move-{tag}"  # B caches none of it: every block moves
    dst, cached = b.handoff.reserve(rid, prompt + done[:-1], tenant=tenant)
    skip = cached // b.config.block_size
    t1 = time.perf_counter()
    move(dst[skip:], list(held.block_ids)[skip:])
    transfers = [time.perf_counter() - t1]
    for _ in range(TRANSFER_REPEATS):  # the same copy again: the block movement alone, steadier
        t1 = time.perf_counter()
        move(dst[skip:], list(held.block_ids)[skip:])
        transfers.append(time.perf_counter() - t1)
    t_transfer = statistics.median(transfers)
    t_move = -sum(transfers[1:])  # the repeats are not part of the move
    a.handoff.release(rid)
    first = FirstToken(0, done[-1], None, held.generator_state, tuple(done[:-1]))
    b.handoff.add_prefilled(rid, prompt, None, params, tenant=tenant, firsts=[first])
    next_token(b, rid)
    t_move += time.perf_counter() - t0
    b.abort(rid)
    t0 = time.perf_counter()
    again = f"again-{tag}"
    b.handoff.add_prefilled(again, prompt, None, params, tenant=f"cold-{tag}", recompute=True,
                            firsts=[FirstToken(0, done[-1], earlier=tuple(done[:-1]))])  # fmt: skip
    next_token(b, again)
    t_recompute = time.perf_counter() - t0
    b.abort(again)
    return {
        "prompt_tokens": len(prompt), "produced": produced, "blocks": len(held.block_ids) - skip,
        "transfer_ms": round(t_transfer * 1e3, 1),
        "move_ms": round(t_move * 1e3, 1), "reprefill_ms": round(t_recompute * 1e3, 1),
        "speedup": round(t_recompute / t_move, 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_DIR)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--produced", type=int, default=32)
    p.add_argument("--transport", choices=("bytes", "nixl"), default="bytes")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    config = EngineConfig(model_dir=str(args.model), kv_cache_bytes=256 * 1024**2)
    a, b = LLMEngine(config), LLMEngine(config)
    loop = asyncio.new_event_loop()
    move = nixl_read(a, b, loop) if args.transport == "nixl" else copy_bytes(a, b)
    rows = []
    for n in args.prompt_tokens:
        ids = a.tokenizer.encode(" ".join(f"line {i} of the log;" for i in range(n)))[:n]
        one(a, b, move, ids, args.produced, f"warm{n}")  # first use of these shapes
        rows.append({"transport": args.transport, **one(a, b, move, ids, args.produced, str(n))})
    print(f"{'prompt':>7} {'produced':>8} {'blocks':>6} {'transfer ms':>11} {'move ms':>8} "
          f"{'re-prefill ms':>13} "
          f"{'speedup':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['produced']:>8} {r['blocks']:>6} {r['transfer_ms']:>11} "
              f"{r['move_ms']:>8} "
              f"{r['reprefill_ms']:>13} {r['speedup']:>7}")  # fmt: skip
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"kv_move_{args.transport}.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
