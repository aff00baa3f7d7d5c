"""How many copies a KV hand-off takes under churn: runs of blocks consecutive on both sides
(`libkv.transfer.block_runs`), with the real block pools and block tables of a prefill worker
and a decode worker (`libkv.kv_manager`, prefix caching on), many requests of varied lengths
arriving, prefilling in chunks, handed off, decoding and finishing, with shared prefixes.

The whole churn is bookkeeping (no model, no tensors): it measures the allocator, so the same
script run against another checkout's ``libkv`` gives the before and after::

    PYTHONPATH=/work/main python bench/kv_block_runs.py          # that checkout's allocator
    python -m bench.kv_block_runs --json bench/results/kv_block_runs.json

Prints one table (runs per hand-off, blocks per run) and writes it as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field

from libkv.block_pool import BlockPool
from libkv.kv_manager import KVCacheManager
from libkv.transfer import block_runs

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Churn:
    """The simulated load (tokens unless named otherwise)."""

    requests: int = 600
    prefill_blocks: int = 2048  # the prefill worker's pool
    decode_blocks: int = 4096  # the decode worker's pool
    chunk: int = 512  # prefill chunk per step and request
    prefixes: tuple[int, ...] = (0, 256, 512, 1024, 2048)  # shared system prompts
    tail: tuple[int, int] = (40, 3000)  # each request's own prompt part
    output: tuple[int, int] = (16, 400)
    arrivals: float = 0.35  # per step
    hold_steps: int = 2  # steps the prefill worker holds the blocks after the hand-off


@dataclass(slots=True)
class Result:
    handoffs: int = 0
    blocks: list[int] = field(default_factory=list)  # moved per hand-off
    runs: list[int] = field(default_factory=list)  # copies per hand-off
    src_runs: list[int] = field(default_factory=list)  # runs of the prefill table alone
    dst_runs: list[int] = field(default_factory=list)  # runs of the decode table alone

    def summary(self) -> dict[str, float]:
        total_b, total_r = sum(self.blocks), sum(self.runs)
        q = statistics.quantiles(self.runs, n=10)
        return {
            "handoffs": self.handoffs,
            "blocks_per_handoff": total_b / self.handoffs,
            "runs_per_handoff_mean": total_r / self.handoffs,
            "runs_per_handoff_p50": statistics.median(self.runs),
            "runs_per_handoff_p90": q[-1],
            "blocks_per_run": total_b / total_r,
            "src_runs_mean": statistics.fmean(self.src_runs),
            "dst_runs_mean": statistics.fmean(self.dst_runs),
            "one_run_share": sum(1 for r in self.runs if r == 1) / self.handoffs,
        }


def _runs(ids: list[int]) -> int:
    return len(block_runs(ids, ids))


class _Sim:
    def __init__(self, churn: Churn, seed: int) -> None:
        self.c, self.rng = churn, random.Random(seed)
        self.p = KVCacheManager(BlockPool(churn.prefill_blocks, BLOCK_SIZE))
        self.d = KVCacheManager(BlockPool(churn.decode_blocks, BLOCK_SIZE))
        base = [self.rng.randrange(1, 50_000) for _ in range(max(churn.prefixes))]
        self.prefix_tokens = [base[:n] for n in churn.prefixes]
        self.waiting: deque[tuple[int, list[int], int]] = deque()
        self.prefilling: dict[int, tuple[list[int], int, int]] = {}  # rid -> prompt, done, out
        self.held: deque[tuple[int, int]] = deque()  # (release step, rid) on the prefill side
        self.decoding: dict[int, int] = {}  # rid -> tokens left
        self.tokens: dict[int, list[int]] = {}  # decoding: prompt and output so far
        self.result = Result()

    def arrive(self, rid: int) -> None:
        c, rng = self.c, self.rng
        tail = [rng.randrange(1, 50_000) for _ in range(rng.randint(*c.tail))]
        prompt = rng.choice(self.prefix_tokens) + tail
        self.waiting.append((rid, prompt, rng.randint(*c.output)))

    def admit(self) -> None:
        while self.waiting:
            rid, prompt, out = self.waiting[0]
            hit = self.p.find_prefix(prompt)
            # Room for the whole prompt, as a prefill worker admits (no chunk waits for room).
            if len(self.prefilling) >= 8 or not self.p.can_admit(hit, len(prompt) + self._owed()):
                return
            done = min(len(hit.blocks) * BLOCK_SIZE, len(prompt) - 1)
            end = min(len(prompt), done + self.c.chunk)
            if self.p.admit(rid, hit, done, end, b"") is None:
                return
            self.waiting.popleft()
            self.prefilling[rid] = (prompt, done, out)
            self.p.commit(rid, prompt, end)
            self.prefilling[rid] = (prompt, end, out)

    def _owed(self) -> int:
        """Prompt tokens the requests in prefill still have to grow by."""
        return sum(len(p) - done for p, done, _ in self.prefilling.values())

    def _decode_owed(self) -> int:
        """Blocks the running decodes still grow by (reserved: a decode never waits)."""
        return sum(
            self.d.blocks_for(len(self.tokens[r]) + left) - len(self.d.block_ids(r))
            for r, left in self.decoding.items()
        )

    def prefill_step(self, step: int) -> None:
        for rid, (prompt, done, out) in list(self.prefilling.items()):
            if done < len(prompt):
                end = min(len(prompt), done + self.c.chunk)
                if self.p.grow(rid, done, end) is None:
                    continue
                self.p.commit(rid, prompt, end)
                self.prefilling[rid] = (prompt, end, out)
            elif self.handoff(rid, prompt, out):
                del self.prefilling[rid]
                self.held.append((step + self.c.hold_steps, rid))

    def handoff(self, rid: int, prompt: list[int], out: int) -> bool:
        hit = self.d.find_prefix(prompt)
        owed = self._decode_owed() + self.d.blocks_for(len(prompt) + out) - len(hit.blocks)
        if owed + sum(1 for b in hit.blocks if b.ref_cnt == 0) > self.d.pool.num_free:
            return False
        if self.d.admit(rid, hit, len(prompt), len(prompt), b"") is None:
            return False
        src, dst = self.p.block_ids(rid), self.d.block_ids(rid)
        moved = slice(len(hit.blocks), len(src))
        r = self.result
        r.handoffs += 1
        r.blocks.append(len(src[moved]))
        r.runs.append(len(block_runs(src[moved], dst[moved])))
        r.src_runs.append(_runs(src[moved]))
        r.dst_runs.append(_runs(dst[moved]))
        self.d.commit(rid, prompt, len(prompt))
        self.decoding[rid], self.tokens[rid] = out, list(prompt)
        return True

    def decode_step(self) -> None:
        for rid, left in list(self.decoding.items()):
            tokens = self.tokens[rid]
            n = len(tokens)
            if left == 0:
                self.d.free(rid)
                del self.decoding[rid], self.tokens[rid]
            elif self.d.grow(rid, n, n + 1) is not None:
                tokens.append(self.rng.randrange(1, 50_000))
                self.decoding[rid] = left - 1
                if (n + 1) % BLOCK_SIZE == 0:  # output blocks enter the prefix cache too
                    self.d.commit(rid, tokens, n + 1)

    def release(self, step: int) -> None:
        while self.held and self.held[0][0] <= step:
            self.p.free(self.held.popleft()[1])

    def run(self) -> Result:
        rid = step = 0
        while rid < self.c.requests or self.waiting or self.prefilling or self.decoding:
            while rid < self.c.requests and self.rng.random() < self.c.arrivals:
                self.arrive(rid)
                rid += 1
            if rid < self.c.requests and not (self.waiting or self.prefilling):
                self.arrive(rid)
                rid += 1
            self.admit()
            self.prefill_step(step)
            self.decode_step()
            self.release(step)
            step += 1
            if step > 1000 * self.c.requests:
                raise RuntimeError("the churn made no progress")
        self.release(step + self.c.hold_steps)
        self.p.check_integrity()
        self.d.check_integrity()
        return self.result


def simulate(churn: Churn = Churn(), seed: int = 0) -> Result:
    """One churn run; the tables' runs of every hand-off."""
    return _Sim(churn, seed).run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=Churn().requests)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    churn = Churn(requests=args.requests)
    rows = [simulate(churn, s).summary() for s in range(args.seeds)]
    keys = list(rows[0])
    print(f"{'seed':>4} " + " ".join(f"{k[:20]:>20}" for k in keys))
    for s, row in enumerate(rows):
        print(f"{s:>4} " + " ".join(f"{row[k]:>20.2f}" for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"churn": asdict(churn), "seeds": rows}, f, indent=1)


if __name__ == "__main__":
    main()
