"""Checked KV on the CUDA IPC path (``pytest -m gpu``): the transport's fused copy-and-sum
takes each block's ``wsum64`` as it copies it; with the sender's sums on the handle the fetch
compares them behind the copy and brings one count back under its one wait, and
`CudaIpcTransport.verify` answers from that count (without them, verify compares on the
device). The test-only fault hook flips one bit in transit, which the check catches, and a
stack with ``--kv-fault corrupt`` recomputes the prompt and serves the clean greedy text.
The peer's pool is a pool of this process here (CUDA IPC cannot map its own allocation); the
mapping between two processes is covered by ``tests/gpu/test_serving_gpu.py``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from libkv.transfer import CUDA_IPC_KEY, DEVICE_KEY, HOST_KEY, block_runs  # noqa: E402
from libkv.transfer.cuda_ipc import CudaIpcTransport, device_uuid, export_pool, host_id  # noqa: E402
from services.common.codec import KVHandle  # noqa: E402

BLOCK_BYTES = 64 * 1024
BLOCKS = 12


@dataclass(frozen=True)
class Source:
    worker_id: str = "p0"
    address: str = ""
    incarnation: str = "i1"
    block_ids: tuple[int, ...] = ()
    block_bytes: int = BLOCK_BYTES
    lease_expires_unix_ms: int = 0


class Records:
    def __init__(self, peer: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> None:
        self.extra_ = {
            HOST_KEY: host_id(),
            DEVICE_KEY: device_uuid(0),
            CUDA_IPC_KEY: export_pool(peer, block_bytes).to_json(),
        }

    async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict[str, str]:
        return self.extra_


def transport(peer: torch.Tensor, fault: str = "") -> tuple[CudaIpcTransport, torch.Tensor]:
    mine = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    t = CudaIpcTransport(mine, BLOCK_BYTES, Records(peer), sums=True, fault=fault)
    t._mapped = lambda name, info: peer  # type: ignore[method-assign]  # same process
    return t, mine


def sender_sums(peer: torch.Tensor, blocks: list[int]) -> list[int]:
    idx = torch.tensor(blocks, device=peer.device)
    return [
        s & ((1 << 64) - 1) for s in reference.block_wsum64(peer.view(torch.int64), idx).tolist()
    ]


@pytest.fixture
def peer() -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda",
                         generator=g)  # fmt: skip


@pytest.mark.parametrize("src", [[3, 4, 5], [9, 1, 7, 2, 11, 0]])  # runs / scattered
def test_a_clean_cuda_ipc_fetch_is_checked_by_the_sums_its_copy_took(peer, src) -> None:
    t, mine = transport(peer)
    dst = [10 - i for i in range(len(src))]

    async def go() -> int | None:
        await t.fetch("r", Source(block_ids=tuple(src)), src, dst, 5.0)
        return await t.verify("r", sender_sums(peer, src))

    assert asyncio.run(go()) == 0
    assert t.fused_fetches == 1
    assert (t.compared_fetches, t.device_verifies) == (0, 1)  # the source carried no sums
    assert torch.equal(mine[dst], peer[src])
    assert asyncio.run(t.verify("r", [1])) is None  # the sums were used up


def test_a_bit_flipped_in_transit_is_caught_and_the_sender_is_untouched(peer) -> None:
    before = peer.clone()
    t, mine = transport(peer, fault="corrupt")
    src, dst = [2, 6, 7], [0, 1, 5]

    async def go() -> int | None:
        await t.fetch("r", Source(block_ids=tuple(src)), src, dst, 5.0)
        return await t.verify("r", sender_sums(peer, src))

    assert asyncio.run(go()) == 1  # exactly the damaged block
    assert torch.equal(peer, before)
    assert (mine[0] != peer[2]).sum().item() == 1  # one byte (one bit) differs
    assert torch.equal(mine[[1, 5]], peer[[6, 7]])


def handle(
    peer: torch.Tensor, ids: list[int], algorithm: str = "wsum64", block_bytes: int = BLOCK_BYTES
) -> KVHandle:
    """The prefill worker's handle of blocks ``ids`` with their ``wsum64`` (as it sends it)."""
    return KVHandle(
        worker_id="p0", incarnation="i1", address="", block_ids=tuple(ids),
        num_tokens=16 * len(ids), block_size=16, block_bytes=block_bytes, dtype="uint8",
        lease_expires_unix_ms=0, block_checksums=tuple(sender_sums(peer, ids)),
        checksum_algorithm=algorithm,
    )  # fmt: skip


async def fetch_verify(
    t: CudaIpcTransport, h: KVHandle, src: list[int], dst: list[int]
) -> int | None:
    """As the decode worker hands off: fetch, then verify with the handle's sums."""
    await t.fetch("r", h, src, dst, 30.0)
    return await t.verify("r", h.block_checksums[len(h.block_ids) - len(src) :])


@pytest.mark.parametrize("skip", [0, 2])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [9, 1, 7, 2, 11, 0]])  # runs / scattered
def test_a_fetch_with_the_senders_sums_is_checked_under_its_one_wait(peer, ids, skip) -> None:
    """As the decode worker fetches (``block_ids[skip:]``, its prefix cache holding the rest)
    and verifies (``block_checksums[skip:]``): the compare ran behind the copy, verify answers
    from its count with no device work, and only once."""
    t, mine = transport(peer)
    h = handle(peer, ids)
    src = list(h.block_ids[skip:])
    dst = [10 - i for i in range(len(src))]

    async def go() -> int | None:
        await t.fetch("r", h, src, dst, 5.0)
        return await t.verify("r", h.block_checksums[skip:])

    assert asyncio.run(go()) == 0
    assert (t.fused_fetches, t.compared_fetches, t.device_verifies) == (1, 1, 0)
    assert torch.equal(mine[dst], peer[src])
    assert asyncio.run(t.verify("r", h.block_checksums[skip:])) is None  # answered once


def test_a_bit_flipped_in_transit_is_counted_behind_the_copy(peer) -> None:
    before = peer.clone()
    t, mine = transport(peer, fault="corrupt")
    h = handle(peer, [2, 6, 7])

    async def go() -> int | None:
        await t.fetch("r", h, [2, 6, 7], [0, 1, 5], 5.0)
        return await t.verify("r", h.block_checksums)

    assert asyncio.run(go()) == 1  # exactly the damaged block
    assert (t.compared_fetches, t.device_verifies) == (1, 0)
    assert torch.equal(peer, before)
    assert (mine[0] != peer[2]).sum().item() == 1
    assert torch.equal(mine[[1, 5]], peer[[6, 7]])


@pytest.mark.parametrize("runs", [False, True])
def test_concurrent_fetches_each_get_their_own_count(peer, runs) -> None:
    """Two hand-offs in flight at once (two pinned counts): a handle with one wrong sum counts
    1, the clean one 0; verify with other sums than the handle's compares on the device (the
    upload path, which keeps the copy's sums), or leaves it to the caller (None: the check of
    runs keeps none)."""
    t, _ = transport(peer)
    t.behind = runs
    good = handle(peer, [1, 2, 3])
    sums = list(good.block_checksums)
    sums[1] ^= 1
    wrong = replace(good, block_checksums=tuple(sums))

    async def go() -> list[int | None]:
        await asyncio.gather(
            t.fetch("a", good, [1, 2, 3], [0, 4, 8], 5.0),
            t.fetch("b", wrong, [1, 2, 3], [5, 6, 7], 5.0),
            t.fetch("c", wrong, [1, 2, 3], [9, 10, 11], 5.0),
        )
        return [
            await t.verify("a", good.block_checksums),
            await t.verify("b", wrong.block_checksums),
            await t.verify("c", good.block_checksums),  # not the sums "c" compared with
        ]

    assert asyncio.run(go()) == [0, 1, None if runs else 0]
    assert (t.compared_fetches, t.device_verifies) == (3, 0 if runs else 1)
    assert t.run_fetches == (3 if runs else 0)


def test_no_compare_for_another_function_and_a_wrong_length_is_an_error(peer) -> None:
    """A handle of another checksum function: the copy still sums, nothing is compared, and
    verify is given no sums (the decode worker then sums the blocks itself); a verify with
    more sums than moved blocks is refused."""
    t, _ = transport(peer)
    other = handle(peer, [4, 5], algorithm="xxh3-64-heads")

    async def go() -> int | None:
        await t.fetch("r", other, [4, 5], [0, 1], 5.0)
        return await t.verify("r", ())

    assert asyncio.run(go()) is None
    assert (t.fused_fetches, t.compared_fetches, t.device_verifies) == (1, 0, 0)
    h = handle(peer, [4, 5])

    async def wrong_length() -> int | None:
        await t.fetch("r", h, [4, 5], [0, 1], 5.0)
        return await t.verify("r", [*h.block_checksums, 7])

    with pytest.raises(ValueError, match="3 expected sums for 2 moved blocks"):
        asyncio.run(wrong_length())


def test_the_fused_check_stores_its_count_in_pinned_memory_or_copies_it_back(peer) -> None:
    """The warm-up found that the fused kernel can store its count straight into pinned host
    memory (CUDA's unified addressing maps it: no copy back); both ways count alike: a wrong
    sum counted, a clean fetch 0, blocks bit for bit, no hop to a thread."""
    t, mine = transport(peer)
    t.behind = False  # the upload path's count (4 runs would take the check of runs)
    found = t.mapped_count
    good = handle(peer, [3, 8, 1, 10])
    sums = list(good.block_checksums)
    sums[2] ^= 1 << 40
    wrong = replace(good, block_checksums=tuple(sums))
    for mapped in (True, False) if found else (False,):
        t.mapped_count = mapped
        mine.zero_()
        assert asyncio.run(fetch_verify(t, wrong, [3, 8, 1, 10], [0, 2, 4, 6])) == 1, mapped
        assert asyncio.run(fetch_verify(t, good, [3, 8, 1, 10], [0, 2, 4, 6])) == 0, mapped
        assert torch.equal(mine[[0, 2, 4, 6]], peer[[3, 8, 1, 10]])
    assert t.device_verifies == t.thread_waits == 0
    assert found  # a 64-bit host with unified addressing: the kernel writes the pinned scalar


@pytest.mark.parametrize("behind", [True, False])
def test_repeated_fetches_of_any_size_leave_the_buffers_zero_and_count_exactly(behind) -> None:
    """Many fetches in a row on one transport (one sums buffer or workspace, one stream; no
    CUDA graph): sizes from one block to more than the first buffer holds (it grows), blocks
    of several programs each, a different number of wrong sums each time, the fault hook's
    split launch in between: every count exact, every block bit for bit, the reused buffers
    zero after each; with the compare behind the copy (the default here), and with the fused
    check (tickets) that a device without mapped pinned memory takes."""
    blocks, bb = 1536, 48 * 1024  # 6144 words: 3 programs per block
    g = torch.Generator(device="cuda").manual_seed(7)
    peer = torch.randint(0, 256, (blocks, bb), dtype=torch.uint8, device="cuda", generator=g)
    mine = torch.zeros(blocks, bb, dtype=torch.uint8, device="cuda")
    clean = CudaIpcTransport(mine, bb, Records(peer, bb), sums=True)
    faulty = CudaIpcTransport(mine, bb, Records(peer, bb), sums=True, fault="corrupt")
    assert clean.behind and faulty.behind
    clean.behind = faulty.behind = behind
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
    for i, n in enumerate([1, 2, 7, 1023, 1024, 1200, 3, 1536, 64, 5]):
        t = faulty if i % 3 == 2 else clean
        t._mapped = lambda name, info: peer  # type: ignore[method-assign]
        src, dst = perm[:n], perm[::-1][:n]
        h = handle(peer, src, block_bytes=bb)
        sums = list(h.block_checksums)
        wrong = list(range(0, n, 3))[: i + 1]
        for k in wrong:
            sums[k] ^= 1
        h = replace(h, block_checksums=tuple(sums))
        damaged = 1 if t.fault and 0 not in wrong else 0
        assert asyncio.run(fetch_verify(t, h, src, dst)) == len(wrong) + damaged, (i, n)
        assert t._work is not None and not t._work.any()
        assert t._run_sums is None or not t._run_sums.any()
        same = (mine[dst] == peer[src]).view(n, -1).all(dim=1)
        assert same[1:].all() and bool(same[0]) == (not t.fault)
    assert clean.device_verifies == faulty.device_verifies == 0
    assert (clean.behind_fetches > 0) == behind


def test_many_concurrent_fetches_keep_their_own_counts(peer) -> None:
    """Eight hand-offs in flight at once on one transport (eight pinned upload buffers, one
    workspace on one stream): each counts its own wrong sums."""
    t, _ = transport(peer)
    good = handle(peer, [1, 2, 3, 4, 5, 6])
    handles = []
    for k in range(8):
        sums = list(good.block_checksums)
        for j in range(k % 4):
            sums[j] ^= 1 << 63
        handles.append(replace(good, block_checksums=tuple(sums)))

    async def go() -> list[int | None]:
        await asyncio.gather(*(
            t.fetch(f"r{k}", h, list(h.block_ids), [0, 7, 8, 9, 10, 11], 5.0)
            for k, h in enumerate(handles)
        ))  # fmt: skip
        return [await t.verify(f"r{k}", h.block_checksums) for k, h in enumerate(handles)]

    assert asyncio.run(go()) == [k % 4 for k in range(8)]
    assert (t.compared_fetches, t.device_verifies) == (8, 0)
    # Every pinned buffer came back (however many the timing needed in flight: one per
    # fetch at most), and fetches after them take those again: none is made anew.
    kept = {b.data_ptr() for b in t._staged}
    assert 1 <= len(kept) == len(t._staged) <= 8
    for k, h in enumerate(handles):  # one after another: each finds a free buffer
        assert asyncio.run(fetch_verify(t, h, list(h.block_ids), [0, 7, 8, 9, 10, 11])) == k % 4
    assert {b.data_ptr() for b in t._staged} == kept


@pytest.mark.parametrize("behind", [True, False])
def test_fetches_launch_straight_through_the_compiled_kernels(peer, behind) -> None:
    """After the warm-up every checked fetch of scattered blocks launches its kernels through
    their compiled kernels (`kernels.triton_launch.FastLaunch`, no ``kernel[grid]`` on the
    way): the copy and sum then the compare behind it (once the first fetch compiled them), or
    the fused check; and so does the plain copy of scattered blocks once compiled; counts and
    blocks are exact either way."""
    from kernels import triton_copy, triton_copy_check

    t, mine = transport(peer)
    t.behind = behind
    assert t.sums and not triton_copy_check._CHECK.broken
    src, dst = [9, 1, 7, 2, 11, 0], [0, 2, 4, 6, 8, 10]
    h = handle(peer, src)
    launches = (triton_copy._SUM, triton_copy._COMPARE) if behind else (triton_copy_check._CHECK,)
    for i, wrong in enumerate(([], [2], [0, 5], [1, 3, 4])):
        sums = list(h.block_checksums)
        for k in wrong:
            sums[k] ^= 1 << 40
        before = [(f.fast, f.slow) for f in launches]
        got = asyncio.run(fetch_verify(t, replace(h, block_checksums=tuple(sums)), src, dst))
        assert got == len(wrong)
        if i:
            assert [(f.fast, f.slow) for f in launches] == [(a + 1, b) for a, b in before]
        assert torch.equal(mine[dst], peer[src])
    plain = CudaIpcTransport(torch.zeros_like(mine), BLOCK_BYTES, Records(peer), sums=False)
    plain._mapped = lambda name, info: peer  # type: ignore[method-assign]
    for i in range(3):  # the first may compile; the others go straight
        fast = triton_copy._COPY.fast
        asyncio.run(plain.fetch("r", h, src[::-1], dst, 30.0))
        assert torch.equal(plain.pool[dst], peer[src[::-1]])
        assert i == 0 or triton_copy._COPY.fast == fast + 1
    assert not any(f.broken for f in (triton_copy._COPY, *launches))


def test_a_fetch_of_a_few_runs_uploads_nothing_allocates_nothing_and_counts(peer) -> None:
    """The warm-up found the check of runs works here (it reads the sender's sums from pinned
    memory and writes its count there); a fetch of 1 to 4 contiguous runs takes it straight
    through its compiled kernel, with no device allocation (no upload, its sums in a reused
    buffer left zero), and counts exactly; the fault hook's bit is flipped in transit there
    too (the sender untouched); five runs go through the upload."""
    from kernels import triton_copy

    t, mine = transport(peer)
    faulty, theirs = transport(peer, fault="corrupt")  # each transport lands in its own pool
    pools = {id(t): mine, id(faulty): theirs}
    before = peer.clone()
    assert t.behind and faulty.behind and t.mapped_count
    cases = [
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(12))),  # the whole pool, one run
        ([3, 4, 5], [7, 8, 9]),
        ([2, 3, 9, 10, 0], [0, 1, 5, 6, 11]),  # 3 runs
        ([1, 5, 9, 11], [11, 2, 0, 6]),  # 4 runs of one block
    ]
    for k, (src, dst) in enumerate(cases):
        for tr in (t, faulty):
            h = handle(peer, src)
            sums = list(h.block_checksums)
            for j in range(len(src) - 1, -1, -2)[:k]:
                sums[j] ^= 1 << (j % 64)
            wrong = sum(a != b for a, b in zip(sums, h.block_checksums, strict=True))
            h = replace(h, block_checksums=tuple(sums))
            pool = pools[id(tr)]
            pool.zero_()
            asyncio.run(fetch_verify(tr, h, src, dst))  # compiled, buffers grown
            pool.zero_()  # what the straight launch below writes, alone
            fast, runs, cmp = triton_copy._RUNS.fast, tr.run_fetches, triton_copy._COMPARE.fast
            allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
            got = asyncio.run(fetch_verify(tr, h, src, dst))
            assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocs
            damaged = 1 if tr.fault and sums[0] == h.block_checksums[0] else 0
            assert got == wrong + damaged, (k, tr.fault)
            assert (triton_copy._RUNS.fast, tr.run_fetches) == (fast + 1, runs + 1)
            assert triton_copy._COMPARE.fast == cmp + 1
            differ = (pool[dst] != peer[src]).view(len(src), -1).sum(dim=1).tolist()
            assert differ == ([1] if tr.fault else [0]) + [0] * (len(src) - 1)
            assert not tr._run_sums.any()  # type: ignore[union-attr]
    assert torch.equal(peer, before)
    assert not triton_copy._RUNS.broken and not triton_copy._COMPARE.broken
    assert t.device_verifies == faulty.device_verifies == 0
    scattered = [9, 1, 7, 2, 11]
    got = asyncio.run(fetch_verify(t, handle(peer, scattered), scattered, [0, 2, 4, 6, 8]))
    assert got == 0 and t.run_fetches == 2 * len(cases)


@pytest.mark.parametrize("programs", [0, 1, 5, 33], ids=lambda p: f"programs{p}")
@pytest.mark.parametrize("words", [1, 1000, 8192, 8193, 262144])
def test_the_sum_of_a_landed_run_equals_the_reference(words, programs) -> None:
    """Fast (a program a part) or by a few programs taking every n-th part: the same sums."""
    g = torch.Generator(device="cuda").manual_seed(words)
    pool = torch.randint(0, 256, (12, 8 * words), dtype=torch.uint8, device="cuda", generator=g)
    sums = torch.zeros(10, dtype=torch.int64, device="cuda")
    run_sum = kernels.run_wsum64(pool, sums, programs=programs)
    for _ in range(2):  # compiled, then launched straight
        sums.zero_()
        run_sum(3, 7, 2)
        want = reference.block_wsum64(pool.view(torch.int64), torch.arange(3, 10, device="cuda"))
        assert torch.equal(sums[2:9], want) and not sums[:2].any() and not sums[9:].any()


@pytest.mark.parametrize("remote", [False, True], ids=["one-gpu", "as-from-another-gpu"])
def test_runs_fetches_of_any_size_in_flight_together_count_exactly(monkeypatch, remote) -> None:
    """Many fetches of one to four runs, blocks of several programs (tickets), up to more
    blocks than the first workspace and sums buffer hold (they grow), sixteen in flight at once
    on one transport (one workspace, one sums buffer, on one stream): every count exact, the
    workspace and the sums zero after; then each shape alone: its blocks bit for bit.
    ``remote``: the peer's pool taken for one on another GPU (`_check_peer_runs`: copy-engine
    copies in chunks down to four blocks here, each summed where it landed)."""
    from libkv.transfer import cuda_ipc_checks

    blocks, bb = 1536, 48 * 1024  # 6144 words: 3 programs per block
    monkeypatch.setattr(cuda_ipc_checks, "TRAIL_BYTES", 4 * bb)
    g = torch.Generator(device="cuda").manual_seed(11)
    peer = torch.randint(0, 256, (blocks, bb), dtype=torch.uint8, device="cuda", generator=g)
    mine = torch.zeros(blocks, bb, dtype=torch.uint8, device="cuda")
    t = CudaIpcTransport(mine, bb, Records(peer, bb), sums=True)
    t._mapped = lambda name, info: peer  # type: ignore[method-assign]
    if remote:
        t.uuid = "another GPU"
    assert t.behind
    shapes = [(0, 1), (0, 1536), (100, 1100), (5, 7), (1400, 136), (0, 64)]
    jobs = []
    for i in range(16):
        start, n = shapes[i % len(shapes)]
        cuts = sorted({start, start + n // 3, start + n // 2, start + n - n // 5, start + n})
        segs = list(zip(cuts, cuts[1:], strict=False))[: 1 + i % 4]
        segs[-1] = (segs[-1][0], start + n)
        src, dst, at = [], [], start + n
        for a, z in segs:  # the source in order, its segments laid out backwards: one run each
            at -= z - a
            src += range(a, z)
            dst += range(at, at + z - a)
        assert 1 <= len(block_runs(src, dst)) <= 4
        h = handle(peer, src, block_bytes=bb)
        sums = list(h.block_checksums)
        wrong = list(range(i % n, n, max(n // (i + 1), 1)))[: i + 1]
        for k in wrong:
            sums[k] ^= 1 << 62
        jobs.append((f"r{i}", replace(h, block_checksums=tuple(sums)), src, dst, len(wrong)))

    async def go() -> list[int | None]:
        counts = []
        for group in (jobs[:8], jobs[8:]):  # eight in flight (counts from what they read)
            await asyncio.gather(*(t.fetch(r, h, s, d, 30.0) for r, h, s, d, _ in group))
            counts += [await t.verify(r, h.block_checksums) for r, h, *_ in group]
        return counts

    assert asyncio.run(go()) == [w for *_, w in jobs]
    assert (t.peer_run_fetches, t.run_fetches) == ((16, 0) if remote else (0, 16))
    assert t.device_verifies == 0
    assert not t._run_sums.any()  # type: ignore[union-attr]

    async def alone(r: str, h: KVHandle, s: list[int], d: list[int]) -> int | None:
        await t.fetch(r, h, s, d, 30.0)
        return await t.verify(r, h.block_checksums)

    for r, h, s, d, w in jobs[:6]:  # one at a time (in flight, destinations overlap)
        mine.zero_()
        assert asyncio.run(alone(r + "a", h, s, d)) == w
        assert torch.equal(mine[d], peer[s]), r  # what landed is the sender's, bit for bit
