"""Tensor parallelism on CPU (gloo, 2 ranks): greedy output token-exact against TP=1 in fp32 for
random Llama and Qwen2 models and the bundled SmolLM2 (whose 9 heads split 3+6), with chunked
prefill, prefix-cache hits and preemption in the batch; canonical block bytes that move between
engines of different TP sizes; an FP8 LM head's shards (rows with their scales); a rank killed
with -9 takes its engine's process down.

All-reduce sums the ranks' partial products in another order than one matmul does, so TP=2
logits differ from TP=1 by rounding (checked to 1e-4); the random models' logits are peaked
(tests/conftest.py), so greedy choices agree exactly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError
from engine.parallel.ranks import RANK_DIED
from engine.parallel.shard import ModelShard
from kernels import Fp8Weight, reference
from tests.conftest import make_random_model_dir

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# Small budget and pool: long prompts prefill in chunks, the pool preempts under load.
OPTIONS = dict(max_num_batched_tokens=64, num_kv_blocks=10, max_num_seqs=8)


def prompts(vocab: int = 40000) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(10, vocab, (48,), generator=g).tolist()  # a cached prefix
    out = [shared + torch.randint(10, vocab, (n,), generator=g).tolist() for n in (5, 30, 70)]
    out += [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (3, 17, 90)]
    return out


def greedy(model_dir: Path, tp: int) -> list[list[int]]:
    closing: list[str] = []
    with LLM(model_dir, tensor_parallel_size=tp, **OPTIONS) as llm:
        outs = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        llm.engine.check_integrity()
        assert llm.engine.pool.num_used == 0
        if tp > 1:
            assert llm.engine.stats().num_preemptions > 0  # the small pool preempted
            _record_calls(
                closing, (llm.engine.runner, "release_graphs"), (llm.engine.ranks, "close")
            )
    # The decode graphs go before the process group: on GPUs NCCL's shutdown waits for them.
    assert closing == (["release_graphs", "close"] if tp > 1 else [])
    return outs


def _record_calls(into: list[str], *methods: tuple[object, str]) -> None:
    """Each ``(obj, name)`` method appends its name to ``into`` when called, then runs."""
    for obj, name in methods:
        method = getattr(obj, name)

        def recorded(*args, _method=method, _name=name, **kwargs):
            into.append(_name)
            return _method(*args, **kwargs)

        setattr(obj, name, recorded)


def test_leaving_a_process_group_that_hangs_gives_up_after_its_timeout(monkeypatch):
    """A shutdown that never returns (NCCL's, waiting on a peer or a graph) does not hang the
    closing engine: `leave_group` stops waiting after its timeout and says so."""
    import threading

    from engine.parallel import comm

    release = threading.Event()
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm.dist, "destroy_process_group", lambda: release.wait(30))
    t0 = time.monotonic()
    assert comm.leave_group(timeout=0.3) is False
    assert 0.3 <= time.monotonic() - t0 < 5
    release.set()
    monkeypatch.setattr(comm.dist, "destroy_process_group", lambda: None)
    assert comm.leave_group(timeout=5) is True


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smol_dir) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("tp"), smol_dir, "llama", seed=3)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smol_dir) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("tp"), smol_dir, "qwen2", seed=4)


@pytest.mark.parametrize("name", ["llama", "qwen2", "smollm2"])
def test_tp2_greedy_matches_tp1(name, llama_dir, qwen_dir, smol_dir):
    model_dir = {"llama": llama_dir, "qwen2": qwen_dir, "smollm2": smol_dir}[name]
    assert greedy(model_dir, 2) == greedy(model_dir, 1)


def test_kv_heads_replicate_over_more_ranks_than_kv_heads(llama_dir):
    """TP=4 over the random Llama's 2 KV heads: each head on two ranks, which split its group
    of query heads; logits and greedy output match TP=1."""
    batch = prompts()[:3]
    with LLM(llama_dir, num_kv_blocks=40) as one:
        ref = [o.token_ids for o in one.generate(batch, GREEDY)]
        ref_logits = one.engine.score(batch[1])
    with LLM(llama_dir, num_kv_blocks=40, tensor_parallel_size=4) as four:
        shards = [
            four.engine.runner.comm.shard,
            *(ModelShard.of(four.engine.runner.model_config, 4, r) for r in (1, 2, 3)),
        ]
        assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
        assert [s.heads for s in shards] == [(0, 1), (1, 2), (2, 3), (3, 4)]
        torch.testing.assert_close(four.engine.score(batch[1]), ref_logits, atol=1e-4, rtol=0)
        assert [o.token_ids for o in four.generate(batch, GREEDY)] == ref


def test_scores_and_canonical_blocks_match_across_tp_sizes(llama_dir):
    """Logits agree to rounding; a TP=2 engine reads its blocks back as every head in order
    (the bytes a TP=1 pool holds), and takes such blocks in, each rank keeping its heads."""
    prompt = prompts()[5]
    with LLM(llama_dir, num_kv_blocks=40) as one:
        ref_logits = one.engine.score(prompt)
        ref_blocks = held_blocks(one, prompt)
        ref_tokens = continue_from(one, prompt, ref_blocks)
    with LLM(llama_dir, num_kv_blocks=40, tensor_parallel_size=2) as two:
        torch.testing.assert_close(two.engine.score(prompt), ref_logits, atol=1e-4, rtol=0)
        blocks = held_blocks(two, prompt)
        assert len(blocks) == len(ref_blocks)
        for got, ref in zip(blocks, ref_blocks, strict=True):
            torch.testing.assert_close(as_floats(got), as_floats(ref), atol=1e-4, rtol=0)
        # The TP=1 engine's blocks decode on at TP=2 as they did at TP=1 (and vice versa).
        assert continue_from(two, prompt, ref_blocks) == ref_tokens
    with LLM(llama_dir, num_kv_blocks=40) as one:
        assert continue_from(one, prompt, blocks) == ref_tokens


def test_tp2_fp8_lm_head_shards_are_the_whole_heads_rows(llama_dir):
    """``quantize_lm_head`` at TP=2 (the random Llama's head is its own, untied): rank 0 holds the
    first rows of the TP=1 engine's quantized head with their scales, and the gathered logits
    of both ranks are the TP=2 model's hidden states times that whole head."""
    prompt = prompts()[4]
    opts = dict(num_kv_blocks=40, quantization="fp8", quantize_lm_head=True)
    with LLM(llama_dir, **opts) as one:
        head = one.engine.runner.model.w.lm_head
    assert isinstance(head, Fp8Weight)
    with LLM(llama_dir, tensor_parallel_size=2, **opts) as two:
        part = two.engine.runner.model.w.lm_head
        lo, hi = two.engine.runner.comm.shard.vocab
        assert isinstance(part, Fp8Weight) and lo == 0 < hi < head.shape[0]
        assert torch.equal(part.scale, head.scale[:hi])
        assert torch.equal(part.weight.view(torch.uint8), head.weight[:hi].view(torch.uint8))
        hidden = torch.cat(two.engine._passes.alone(prompt, None, two.engine.runner.hidden_all))
        logits = two.engine.score(prompt)
        assert logits.shape == (len(prompt), head.shape[0])
        torch.testing.assert_close(logits, reference.linear(hidden, head), atol=1e-4, rtol=0)
        out = two.generate([prompt], GREEDY)[0].token_ids
        assert len(out) == MAX_TOKENS


def held_blocks(llm: LLM, prompt: list[int]) -> list[bytes]:
    """Prefill ``prompt`` as a hand-off and read its held blocks (canonical bytes)."""
    eng = llm.engine
    eng.add_request("p", prompt, SamplingParams(max_tokens=2, temperature=0), hold_kv=True)
    while eng.has_unfinished():
        eng.step()
    data = eng.handoff.read_blocks(eng.handoff.held_block_ids("p"))
    eng.handoff.release("p")
    return data


def continue_from(llm: LLM, prompt: list[int], blocks: list[bytes]) -> list[int]:
    """Decode greedily from ``blocks`` written into reserved blocks (a decode hand-off; a
    tenant of its own, so nothing this engine cached before is reused)."""
    eng = llm.engine
    dst, cached = eng.handoff.reserve("d", prompt, tenant="handoff")
    assert cached == 0
    eng.handoff.write_blocks(dst, blocks)
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    eng.handoff.add_prefilled("d", prompt, first, GREEDY, tenant="handoff")
    out: list[int] = []
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                out = o.token_ids
    return out


def as_floats(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.float32)


def test_unsplittable_sizes_are_refused_before_any_rank_starts(llama_dir):
    with pytest.raises(UnsupportedModelError, match="without a query head"):
        LLM(llama_dir, tensor_parallel_size=5)  # 4 heads


RANK_DEATH = """
import sys, time
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=64)
print("PIDS", *llm.engine.ranks.pids(), flush=True)
while True:
    llm.generate([[5, 6, 7] * 20], SamplingParams(max_tokens=8, ignore_eos=True))
"""


def test_a_rank_killed_with_sigkill_takes_the_engine_process_down(llama_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK_DEATH, str(llama_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("PIDS"), proc.stderr.read() if proc.stderr else line
        rank1 = int(line.split()[1])
        time.sleep(1.0)  # generating: the kill lands mid-step or between steps
        os.kill(rank1, signal.SIGKILL)
        t0 = time.monotonic()
        rc = proc.wait(timeout=10)
        err = proc.stderr.read() if proc.stderr else ""
        assert rc == RANK_DIED, err
        assert time.monotonic() - t0 < 5
        assert "tensor-parallel rank tandem-rank1" in err and "exited with -9" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stack_dumps_of_every_rank_for_a_hang(llama_dir):
    """``TANDEM_DUMP_STACKS_S``: rank 0 and every other rank write their threads' stacks to
    stderr every so often (what a hang inside a collective needs to be found); off unless set."""
    code = (
        "import time\n"
        "from engine import LLM\n"
        f"with LLM({str(llama_dir)!r}, tensor_parallel_size=2, num_kv_blocks=40) as llm:\n"
        "    time.sleep(1.5)\n"
    )
    env = {**os.environ, "TANDEM_DUMP_STACKS_S": "0.5"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).parents[2])  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    dumps = out.stderr.count("Timeout (0:00:00.500000)!")
    assert dumps >= 2, out.stderr[-2000:]
    assert "rank_main" in out.stderr  # rank 1's main thread, in its command loop
    assert "<string>" in out.stderr  # rank 0's, in the script
