"""Checked KV: every block a prefill worker hands off carries a checksum computed where the
pool lives; the decode worker checks what arrived and recomputes the prompt on a mismatch,
counting the corrupt blocks, so corrupt KV is never served. Unit tests of the checksums, and
stacks (TP 1, and TP 2 on both sides) whose decode worker damages every transfer (the
test-only ``--kv-fault corrupt``)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import urllib.request
from types import SimpleNamespace

import openai
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_checksum import MASK, BlockChecksums, combine
from libkv.transfer.nixl_agent import nixl_available
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack.test_e2e_stack import LONG, MODEL, assert_all_free, offline_greedy

ALGORITHMS = ["xxh3-64-heads", "wsum64", "crc32"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_changed_word_changes_the_checksum(dtype, algorithm) -> None:
    """Every function (XXH3 per head for host pools, the odd-weighted sum for GPU pools,
    CRC-32 of older senders) over a head-major pool ``[blocks, heads, layers, 2, bs, dim]``."""
    torch.manual_seed(0)
    cache = torch.randn(6, 2, 2, 2, 16, 8).to(dtype)
    sums = BlockChecksums(cache, algorithm)
    cache[3] = cache[1]  # same bytes in another block: same checksum
    base = sums([0, 1, 2, 3])
    assert base[1] == base[3] and len(set(base[:3])) == 3
    assert all(0 <= s <= MASK for s in base)
    words = cache.view(-1).view(torch.int64).view(6, -1)
    for pos in (0, 7, words.shape[1] // 2, words.shape[1] - 1):  # in either head, top bit too
        for bit in (0, 63):
            saved = int(words[2, pos])
            words[2, pos] ^= -(1 << 63) if bit == 63 else 1
            assert sums([2]) != [base[2]], (pos, bit)
            words[2, pos] = saved
    assert sums([2]) == [base[2]]
    swapped = words[2].clone()
    words[2, 0], words[2, 1] = swapped[1], swapped[0]  # two words trade places
    assert sums([2]) != [base[2]] or bool(swapped[0] == swapped[1])
    words[2] = swapped
    heads = cache[2].clone()
    cache[2, 0], cache[2, 1] = heads[1], heads[0]  # the two heads trade places
    assert sums([2]) != [base[2]]
    before = sums([5])
    cache[5].zero_()  # what an incomplete transfer leaves
    assert sums([5]) != before


@pytest.mark.parametrize("algorithm", ["xxh3-64-heads", "wsum64"])
@pytest.mark.parametrize(("heads", "tp"), [(4, 2), (3, 2), (4, 4), (2, 4)])
def test_ranks_parts_add_up_to_the_canonical_checksum(algorithm, heads, tp) -> None:
    """Under tensor parallelism each rank sums its heads of a block (a replicated head once)
    and the parts add up to the canonical block's checksum: sender and receiver agree at any
    two TP sizes, as KV moves between them."""
    from engine.kv_pool import allocate
    from libkv.kv_layout import KVLayout

    torch.manual_seed(1)
    canon = KVLayout(2, heads, 8, 16, "float32", 4)
    whole = torch.randn(5, heads, 2, 2, 16, 8)
    expected = BlockChecksums(whole, algorithm)([0, 2, 4])
    layout = KVLayout(2, heads, 8, 16, "float32", 4, tp=tp)
    parts = []
    for rank in range(tp):
        lo, hi = layout.heads(rank)
        shard = allocate(layout, rank, 5, torch.float32, torch.device("cpu"))
        shard.copy_(whole[:, lo:hi])
        parts.append(BlockChecksums(shard, algorithm, lo, layout.first_holder(rank))([0, 2, 4]))
    assert combine(parts) == expected
    assert canon.block_bytes == whole[0].numel() * 4


def test_an_unknown_checksum_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV checksum"):
        BlockChecksums(torch.zeros(2, 1, 8), "md5")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="the Triton kernel on CPU needs triton and TRITON_INTERPRET=1 (CUDA: test_kernels_gpu)",
)
@pytest.mark.parametrize(("words", "offset"), [(8, 0), (1000, 7), (3 * 8192 + 5, 2**40 + 3)])
def test_triton_wsum64_equals_the_torch_reference_interpreted(words, offset) -> None:
    """The Triton ``wsum64`` (one read of each block in place, chunks added atomically) gives
    the reference's value bit for bit, on block ids in any order, top bits set included."""
    from kernels import reference
    from kernels.triton_checksum import block_wsum64

    torch.manual_seed(2)
    pool = torch.randint(-(2**63), 2**63 - 1, (5, words), dtype=torch.int64)
    idx = torch.tensor([4, 0, 2, 0], dtype=torch.int32)
    want = reference.block_wsum64(pool, idx.long(), offset)
    assert torch.equal(block_wsum64(pool, idx, offset), want)


class _FusedTransport:
    """A transport whose copy took the sums (as `CudaIpcTransport` with ``sums``): ``verify``
    answers with ``bad`` mismatches, None where the fetch took none."""

    name = "cuda-ipc"

    def __init__(self, bad: int | None) -> None:
        self.bad = bad
        self.asked: list[tuple[str, tuple]] = []

    async def verify(self, request_id, expected):
        self.asked.append((request_id, tuple(expected)))
        return self.bad if expected else None


class _Engine:
    """Only what `DecodeCore._check` reaches of the engine client (`EngineClient`): its
    ``info``, and summing or writing blocks, which record the call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.info = SimpleNamespace(device="cpu", layout=SimpleNamespace(block_bytes=8))

    async def block_checksums(self, ids, algorithm):
        self.calls.append("block_checksums")
        return [7] * len(ids)

    async def write_blocks(self, ids, data):
        self.calls.append("write_blocks")


def _job(algorithm: str, sums: tuple[int, ...]) -> SimpleNamespace:
    kv = SimpleNamespace(block_checksums=sums, checksum_algorithm=algorithm, worker_id="p0")
    return SimpleNamespace(request_id="r1", kv=kv)


@pytest.mark.parametrize("bad", [0, 2])
def test_the_decode_check_uses_the_sums_the_copy_took(bad) -> None:
    """Through the observed and path transports to the CUDA IPC one: the count comes from the
    device compare of the copy's sums, no arrived block is read or written again (the fault
    hook then damages in transit, in the transport, not after arrival)."""
    from libkv.transfer.observed import ObservedTransport
    from libkv.transfer.path import PathTransport
    from services.decode.core import DecodeCore

    local = _FusedTransport(bad)
    network = SimpleNamespace(name="grpc")
    transport = ObservedTransport(PathTransport(None, {}, network, local), None)  # type: ignore[arg-type]
    engine = _Engine()
    core = DecodeCore(engine, transport, "d0", "i", fault="corrupt")  # type: ignore[arg-type]
    got = asyncio.run(core._check(_job("wsum64", (1, 2, 3, 4)), [5, 6, 7], 1))
    assert got == bad and core.fused_checks == 1
    assert local.asked == [("r1", (2, 3, 4))]
    assert engine.calls == []  # no block read again, none damaged after arrival


def test_the_decode_check_reads_the_blocks_where_the_copy_took_no_sums() -> None:
    """Another function than wsum64 (or a fetch that went another way): the transport drops
    its sums and the arrived blocks are damaged by the fault hook, then summed and compared."""
    from services.decode.core import DecodeCore

    local = _FusedTransport(0)
    engine = _Engine()
    core = DecodeCore(engine, local, "d0", "i", fault="corrupt")  # type: ignore[arg-type]
    got = asyncio.run(core._check(_job("xxh3-64-heads", (7, 9)), [5, 6], 0))
    assert got == 1 and core.fused_checks == 0
    assert local.asked == [("r1", ())]
    assert engine.calls == ["write_blocks", "block_checksums"]  # the fault, then the check


@pytest.mark.parametrize("fault", ["", "corrupt"])
def test_the_cuda_ipc_copy_sums_what_it_wrote_and_its_fault_is_in_transit(fault) -> None:
    """`CudaIpcTransport`'s fused copy (the torch reference on CPU, the same dispatch as on a
    GPU): the sums are ``wsum64`` of the blocks as written; with the fault hook one bit of the
    first block differs in what was written *and* in its sum, so the sender's sum mismatches
    exactly there, and the sender's pool is untouched."""
    from kernels import reference
    from libkv.transfer.cuda_ipc import CudaIpcTransport

    bs, n = 256, 8
    peer = torch.randint(0, 256, (n, bs), dtype=torch.uint8)
    before = peer.clone()
    mine = torch.zeros(n, bs, dtype=torch.uint8)
    t = CudaIpcTransport(mine, bs, None, sums=True, fault=fault)  # type: ignore[arg-type]
    src, dst = [5, 1, 6], [0, 7, 3]
    sums, bad, _ = t._copy_sum(peer, src, dst)
    assert bad is None  # no sender's sums given: nothing compared

    def wsum(pool, ids):
        return reference.block_wsum64(pool.view(torch.int64), torch.tensor(ids))

    assert torch.equal(sums, wsum(mine, dst))  # the sums of what landed
    sender = wsum(peer, src)
    assert (sums != sender).tolist() == [fault == "corrupt", False, False]
    assert torch.equal(peer, before)
    assert (mine[dst] != peer[src]).sum().item() == (1 if fault else 0)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="the Triton interpreter (TRITON_INTERPRET=1 with triton installed)",
)
def test_triton_fused_copy_and_sum_equals_copy_then_sum_interpreted() -> None:
    from kernels import reference
    from kernels.triton_copy import copy_sum_blocks_between

    peer = torch.randint(-(2**63), 2**63 - 1, (6, 1000), dtype=torch.int64).view(torch.uint8)
    mine = torch.zeros_like(peer)
    si, di = torch.tensor([4, 0, 2]), torch.tensor([1, 5, 3])
    sums = copy_sum_blocks_between(mine, peer, si, di)
    assert torch.equal(mine[di], peer[si])
    assert torch.equal(sums, reference.block_wsum64(peer.view(torch.int64), si))


@pytest.fixture(scope="module")
def sealing(smol_dir):
    """A prefill-side engine that seals: 24-token chunks, so blocks seal across steps."""
    return LLMEngine(
        EngineConfig(
            model_dir=str(smol_dir), kv_cache_bytes=64 * 1024**2, max_num_batched_tokens=24,
            seal_checksums=True,
        )
    )  # fmt: skip


def test_a_handoff_reads_the_sums_taken_when_its_blocks_were_sealed(sealing) -> None:
    """Each full block is summed once, when sealed (the step that completed it); the hand-off
    sends that kept sum and sums only the last, partial block then."""
    eng = sealing
    prompt = list(range(100, 140))  # 40 tokens: blocks of 16, 16 and 8
    eng.add_request("s", prompt, SamplingParams(max_tokens=4), hold_kv=True)
    while eng.has_unfinished():
        eng.step()
    ids = eng.handoff.held_block_ids("s")
    assert [eng.pool.blocks[i].sealed for i in ids] == [True, True, False]
    fresh = eng.handoff.block_checksums(ids)
    assert eng.handoff.handoff_checksums(ids) == fresh
    # Damage every block behind the engine's back: the sealed ones still send the sums taken
    # at sealing (the bytes sent then would mismatch on arrival), the partial one is summed now.
    damaged = [b"\x5a" * eng.runner.layout.block_bytes] * 3
    eng.handoff.write_blocks(ids, damaged)
    now = eng.handoff.block_checksums(ids)
    sent = eng.handoff.handoff_checksums(ids)
    assert sent[:2] == fresh[:2] and sent[2] == now[2] != fresh[2]
    assert now[0] != fresh[0]
    assert eng.handoff.release("s")
    eng.check_integrity()


# (prefill TP, decode TP, transport). At TP 2 on both sides each rank sums its KV heads and
# rank 0 adds the parts up, on the sender and on the receiver: a wrong combination on either
# side would make every block mismatch, not just the damaged one. Over NIXL where importable
# (each decode rank READs its heads from the prefill ranks, `libkv.transfer.sharded`).
TP_TRANSPORT = "nixl" if nixl_available() else "grpc"
SHAPES = [
    pytest.param((1, 1, "grpc"), id="tp1-grpc"),
    # Four engine processes on this 2-core machine: about 90 s with its stack.
    pytest.param((2, 2, TP_TRANSPORT), id=f"p2-d2-{TP_TRANSPORT}", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=SHAPES)
def stack(smol_dir, tmp_path_factory, request):
    prefill_tp, decode_tp, transport = request.param
    config = StackConfig(
        model_dir=str(smol_dir), run_dir=str(tmp_path_factory.mktemp("checked")),
        port=free_port(), num_prefill=1, num_decode=1, kv_transport=transport,
        prefill_tp=prefill_tp, decode_tp=decode_tp, start_timeout=300.0,
        worker_args=("--kv-fault", "corrupt"),  # decode damages every transfer's first block
    )  # fmt: skip
    with Stack(config) as s:
        yield s


def decode_metric(stack: Stack, name: str) -> float:
    target = stack.scrape_targets()["decode-0"]
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name):
                return float(line.split()[-1])
    raise AssertionError(f"no {name}")


@pytest.mark.timeout(300)
def test_a_block_corrupted_in_transit_is_detected_and_recomputed(stack, smol_dir):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)
    offline = LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=64 * 1024**2))
    ref = offline_greedy(offline, offline.tokenizer.encode(LONG), 16)
    before = decode_metric(stack, "tandem_kv_transfer_corrupt_blocks_total")
    out = client.completions.create(model=MODEL, prompt=LONG, max_tokens=16, temperature=0)
    assert out.choices[0].text == ref.text  # the damaged KV was never used
    # Exactly the damaged block: the others, checked too, match the sender's sums.
    assert decode_metric(stack, "tandem_kv_transfer_corrupt_blocks_total") == before + 1
    assert decode_metric(stack, "tandem_kv_handoff_recomputed_total") >= 1
    log = stack.children["decode-0"].log_path.read_text()
    assert "arrived corrupt; recomputing it here" in log
    assert_all_free(stack, within=10)
