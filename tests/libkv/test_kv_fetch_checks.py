"""The CUDA IPC hand-off's check behind the copy, off the GPU: which of the handle's sums belong
to the fetched blocks (`libkv.transfer.fetch_checks`), what `verify` answers from what a fetch
kept, the compare-and-count step (``kernels.count_mismatches``: torch reference, and the
Triton kernel under ``TRITON_INTERPRET=1``), and the transport's fused copy with the compare
on CPU tensors (the same dispatch as on a GPU). On CUDA: ``tests/gpu/test_kv_checked_gpu.py``."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import os
import time
from dataclasses import dataclass, replace

import pytest
import torch

import kernels
from engine.kv_checksum import WSUM64, legacy_algorithm
from kernels import reference
from libkv.transfer import cuda_ipc_checks, fetch_checks
from libkv.transfer.fetch_checks import FetchChecks, Kept, sender_sums, signed64
from services.common.codec import KVHandle

TOP = (1 << 64) - 5  # a sum whose top bit is set (negative as int64)
IDS = (7, 3, 9, 12, 5)
SUMS = (11, TOP, 1 << 63, 0, 42)

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="the Triton interpreter (TRITON_INTERPRET=1 with triton installed)",
)


def handle(ids=IDS, sums=SUMS, algorithm: str = WSUM64) -> KVHandle:
    return KVHandle(
        worker_id="p0", incarnation="i1", address="", block_ids=tuple(ids), num_tokens=80,
        block_size=16, block_bytes=256, dtype="bfloat16", lease_expires_unix_ms=0,
        block_checksums=tuple(sums), checksum_algorithm=algorithm,
    )  # fmt: skip


def test_the_transport_names_the_engines_gpu_checksum() -> None:
    assert fetch_checks.WSUM64 == WSUM64 == legacy_algorithm(torch.device("cuda"))


@pytest.mark.parametrize("skip", range(len(IDS)))
def test_sums_by_block_id_are_the_decode_workers_suffix(skip) -> None:
    """The decode worker fetches ``block_ids[skip:]`` (its prefix cache holds the rest) and
    verifies against ``block_checksums[skip:]``: the by-id lookup gives exactly those."""
    h = handle()
    assert sender_sums(h, h.block_ids[skip:]) == h.block_checksums[skip:]


def test_sums_of_any_subset_follow_the_fetch_order() -> None:
    assert sender_sums(handle(), [12, 7, 5]) == (0, 11, 42)
    # A sum sent as a signed value (its bits) is the same unsigned sum.
    assert sender_sums(handle(sums=(11, TOP - (1 << 64), 1 << 63, 0, 42)), [3]) == (TOP,)
    # No algorithm named: an older GPU sender, which computed wsum64.
    assert sender_sums(handle(algorithm=""), [9]) == (1 << 63,)
    # One block named twice with one sum is still one sum.
    assert sender_sums(handle(ids=(4, 4), sums=(8, 8)), [4]) == (8,)


@dataclass(frozen=True)
class _BareSource:  # a KVSource without checksums (the protocol names none)
    worker_id: str = "p0"
    address: str = ""
    incarnation: str = "i1"
    block_ids: tuple[int, ...] = IDS
    block_bytes: int = 256
    lease_expires_unix_ms: int = 0


@pytest.mark.parametrize(
    ("source", "blocks"),
    [
        (handle(sums=()), [7]),  # the sender sent none
        (handle(algorithm="xxh3-64-heads"), [7]),  # another function: the caller sums itself
        (handle(sums=SUMS[:-1]), [7]),  # not one sum per block: cannot be matched
        (handle(), [7, 8]),  # a block the handle does not name
        (handle(ids=(4, 4), sums=(8, 9)), [4]),  # one block, two sums: trust neither
        (_BareSource(), [7]),
    ],
)
def test_no_sums_where_the_handle_cannot_give_them(source, blocks) -> None:
    assert sender_sums(source, blocks) is None


def test_signed64_keeps_the_bits() -> None:
    got = torch.tensor(signed64([TOP, 1 << 63, 5, -1, (1 << 64) - 1]), dtype=torch.int64)
    assert got.tolist() == [-5, -(1 << 63), 5, -1, -1]


def _kept(compared=(1, TOP), count=0) -> Kept:
    return Kept(torch.tensor(signed64([1, TOP])), 2, compared, count)


def test_verify_answers_with_the_count_the_fetch_found_once() -> None:
    checks = FetchChecks()
    checks.keep("r", _kept(count=1))
    assert checks.take("r", [1, TOP - (1 << 64)]) == 1  # signed or unsigned: the same sums
    assert checks.take("r", [1, TOP]) is None  # answered: forgotten
    assert len(checks) == 0


def test_verify_compares_now_where_the_fetch_did_not_or_with_other_sums() -> None:
    checks = FetchChecks()
    checks.keep("r", _kept(compared=None, count=None))  # the handle carried no sums
    got = checks.take("r", [1, TOP])
    assert isinstance(got, Kept) and got.blocks == 2
    checks.keep("r", _kept())
    assert isinstance(checks.take("r", [1, 2]), Kept)  # other sums than the fetch compared


def test_verify_without_sums_or_expected_is_none_and_a_wrong_length_is_an_error() -> None:
    checks = FetchChecks()
    assert checks.take("nothing", [1, 2]) is None
    checks.keep("r", _kept())
    assert checks.take("r", []) is None  # the sender sent none: the caller checks
    assert checks.take("r", [1, TOP]) is None  # and that dropped what was kept
    checks.keep("r", _kept())
    with pytest.raises(ValueError, match="3 expected sums for 2 moved blocks"):
        checks.take("r", [1, TOP, 3])
    assert len(checks) == 0


def test_kept_fetches_age_out_oldest_first() -> None:
    checks = FetchChecks(limit=2)
    for rid in ("a", "b", "c"):
        checks.keep(rid, _kept(count=ord(rid)))
    checks.keep("b", _kept(count=7))  # fetched again: the newest now
    checks.keep("d", _kept(count=8))
    assert [checks.take(r, [1, TOP]) for r in "abcd"] == [None, 7, None, 8]


def _mismatched(n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(n)
    got = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=g)
    want = got.clone()
    bad = torch.randperm(n, generator=g)[: n // 3]
    want[bad] ^= -(1 << 63)  # only the top bit differs
    if n > 2:
        want[-1] ^= 1  # and the last entry, in the lowest bit
    return got, want, int((got != want).sum())


@pytest.mark.parametrize("n", [0, 1, 7, 1024, 2500])
def test_count_mismatches_off_cuda_is_the_reference(n) -> None:
    got, want, bad = _mismatched(n)
    out = kernels.count_mismatches(got, want)
    assert out.shape == () and out.dtype == torch.int64 and int(out) == bad
    assert int(reference.count_mismatches(got, want)) == bad


def test_count_mismatches_refuses_sums_that_do_not_pair() -> None:
    with pytest.raises(ValueError, match="1-D tensors alike"):
        kernels.count_mismatches(
            torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
        )
    with pytest.raises(ValueError, match="int64 sums"):
        kernels.count_mismatches(
            torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)
        )


@interpreted
@pytest.mark.parametrize("n", [0, 1, 7, 1024, 1025, 2500])
def test_triton_count_mismatches_equals_the_reference_interpreted(n) -> None:
    from kernels.triton_checksum import count_mismatches

    got, want, bad = _mismatched(n)
    out = count_mismatches(got, want)
    assert out.shape == () and out.dtype == torch.int64
    assert torch.equal(out, reference.count_mismatches(got, want)) and int(out) == bad


def _transport(fault: str):
    from libkv.transfer.cuda_ipc import CudaIpcTransport

    mine = torch.zeros(8, 256, dtype=torch.uint8)
    return CudaIpcTransport(mine, 256, None, sums=True, fault=fault), mine  # type: ignore[arg-type]


def _peer(seed: int) -> torch.Tensor:
    """A peer's pool of 8 random 256-byte blocks."""
    return torch.randint(
        0, 256, (8, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _wsum(pool: torch.Tensor, ids: list[int]) -> list[int]:
    words = pool.view(torch.int64).view(pool.shape[0], -1)
    return [
        s & fetch_checks.MASK for s in reference.block_wsum64(words, torch.tensor(ids)).tolist()
    ]


@pytest.mark.parametrize("fault", ["", "corrupt"])
def test_the_fused_copy_compares_with_the_senders_sums_behind_the_copy(fault) -> None:
    """`CudaIpcTransport._copy_sum` with the sender's sums: the count is that of the blocks
    whose sums as written differ from them: the damaged block in transit (fault hook), and
    any whose expected sum is wrong."""
    t, mine = _transport(fault)
    peer = torch.randint(
        0, 256, (8, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    src, dst = [5, 1, 6, 2], [0, 7, 3, 4]
    want = _wsum(peer, src)
    sums, bad, _ = t._copy_sum(peer, src, dst, want)
    assert bad is not None and int(bad) == (1 if fault else 0)
    assert torch.equal(sums, torch.tensor(signed64(_wsum(mine, dst))))  # what landed
    want[2] ^= 1 << 63  # a sender's sum that no block matches
    _, bad, _ = t._copy_sum(peer, src, dst, want)
    assert bad is not None and int(bad) == (2 if fault else 1)
    assert not t._workspace(1).any()  # left zero for the next fetch


def test_the_fused_check_is_bound_once_per_source_pool_and_workspace() -> None:
    """The transport keeps one bound check (`kernels.packed_check`) per source pool: reused by
    the next fetch from the same pool, another for another pool, all dropped when the
    workspace grows (they point at the old one) or the peer's pool is unmapped; every fetch
    still counts exactly."""
    t, mine = _transport("")
    g = torch.Generator().manual_seed(7)
    peer = torch.randint(0, 256, (8, 256), dtype=torch.uint8, generator=g)
    other = torch.randint(0, 256, (8, 256), dtype=torch.uint8, generator=g)
    src, dst = [5, 1, 6], [0, 7, 3]

    def fetch(pool: torch.Tensor, k: int = 3) -> int:
        want = _wsum(pool, src[:k])
        want[0] ^= 1
        _, bad, _ = t._copy_sum(pool, src[:k], dst[:k], want)
        assert bad is not None and torch.equal(mine[dst[:k]], pool[src[:k]])
        return int(bad)

    assert fetch(peer) == 1
    bound = t._checkers[id(peer)]
    assert fetch(peer, 2) == 1 and t._checkers[id(peer)] is bound
    assert fetch(other) == 1 and set(t._checkers) == {id(peer), id(other)}
    work = t._workspace(1)
    t._workspace(work.numel())  # one block more than it holds: a new workspace
    assert t._workspace(1) is not work and not t._checkers
    assert fetch(peer) == 1 and not t._workspace(1).any()
    t._peers["p0@i1"], t._peers["p0@i2"], t._current["p0"] = peer, other, "p0@i1"
    t._mapped("p0@i2", None)  # type: ignore[arg-type]  # a new incarnation: the old unmapped
    assert id(peer) not in t._checkers


def test_the_bound_check_is_the_packed_check() -> None:
    """``kernels.packed_check`` off CUDA: the call of `copy_sum_check_packed` it stands for
    (copy, sums into the upload, the count once ``total`` blocks are done), and bad counts
    refused."""
    g = torch.Generator().manual_seed(9)
    peer = torch.randint(0, 256, (6, 128), dtype=torch.uint8, generator=g)
    mine = torch.zeros_like(peer)
    work = torch.zeros(5, dtype=torch.int64)
    check = kernels.packed_check(mine, peer, work)
    src, dst = [4, 0, 5], [1, 3, 2]
    want = signed64(_wsum(peer, src))
    want[2] ^= 1 << 40
    out = torch.full((), -1, dtype=torch.int64)
    first = torch.tensor([*src[:2], *dst[:2], *want[:2], 0, 0], dtype=torch.int64)
    check(first, 2, out, 3)  # 2 of 3 blocks: no count yet
    assert int(out) == -1 and torch.equal(mine[dst[:2]], peer[src[:2]])
    check(torch.tensor([src[2], dst[2], want[2], 0], dtype=torch.int64), 1, out, 3)
    assert int(out) == 1 and not work.any()  # all three counted, the workspace left zero
    up = torch.tensor([*src, *dst, *want, 0, 0, 0], dtype=torch.int64)
    out.fill_(-1)
    check(up, 3, out)  # total defaults to this call's blocks
    assert int(out) == 1 and torch.equal(mine[dst], peer[src])
    assert torch.equal(up[9:], torch.tensor(signed64(_wsum(mine, dst))))
    with pytest.raises(ValueError):
        check(up, 5, out)  # 5 blocks need 20 uploaded words


def test_verify_answers_a_compared_fetch_with_no_device_work() -> None:
    """What `fetch` keeps after its compare (a CPU transport: no CUDA to touch, so any device
    work here would fail): `verify` returns the count, then None; another transport's fetch
    (nothing kept) gets None, and the caller checks the blocks itself."""
    t, _ = _transport("")
    t._checks.keep("r", Kept(torch.zeros(2, dtype=torch.int64), 2, (1, TOP), 1))
    assert asyncio.run(t.verify("r", [1, TOP])) == 1
    assert asyncio.run(t.verify("r", [1, TOP])) is None
    assert asyncio.run(t.verify("other", [1, TOP])) is None
    assert t.device_verifies == 0


def test_a_handle_that_crossed_the_wire_gives_the_same_sums() -> None:
    """Sums travel as uint64 in the proto: what arrives maps to the same fetched blocks."""
    from services.common.codec import handle_from_pb, handle_to_pb

    sent = handle()
    got = handle_from_pb(handle_to_pb(sent))
    assert sender_sums(got, [9, 3]) == sender_sums(sent, [9, 3]) == (1 << 63, TOP)


def _check_args(n: int, tickets: int | None = None) -> tuple[torch.Tensor, ...]:
    """Zeroed sums, a workspace (state word, then tickets) and an ``out`` preset to -1."""
    work = torch.zeros(1 + (n if tickets is None else tickets), dtype=torch.int64)
    return torch.zeros(n, dtype=torch.int64), work, torch.full((), -1, dtype=torch.int64)


def _fused_check_case(check, words: int) -> None:
    """The fused copy, sum and compare (``check``: the torch reference through
    ``kernels``, or the Triton kernel interpreted): blocks land bit for bit, each block's
    ``wsum64`` as written is in ``sums``, the wrong expected sum is counted, and the workspace
    is left zero, so the next call on it (three in a row, then a split in two launches that
    share one count, as the fault hook launches) counts right again."""
    g = torch.Generator().manual_seed(3)
    peer = torch.randint(-(2**63), 2**63 - 1, (7, words), dtype=torch.int64, generator=g)
    si, di = torch.tensor([4, 0, 2, 6, 1]), torch.tensor([1, 5, 3, 0, 6])
    truth = reference.block_wsum64(peer, si)
    work = torch.zeros(9, dtype=torch.int64)
    for wrong in ([], [2], [0, 4]):
        mine = torch.zeros_like(peer)
        want = truth.clone()
        want[wrong] ^= 1
        sums, out = torch.zeros(5, dtype=torch.int64), torch.full((), -1, dtype=torch.int64)
        check(mine.view(torch.uint8), peer.view(torch.uint8), si, di, sums, want, work[1:],
              work[:1], out, 5)  # fmt: skip
        assert int(out) == len(wrong)
        assert torch.equal(mine[di], peer[si]) and torch.equal(sums, truth)
        assert not work.any()
    sums, out = torch.zeros(5, dtype=torch.int64), torch.full((), -1, dtype=torch.int64)
    want = truth.clone()
    want[3] += 1
    m8, p8 = torch.zeros_like(peer).view(torch.uint8), peer.view(torch.uint8)
    check(m8, p8, si[:2], di[:2], sums[:2], want[:2], work[1:], work[:1], out, 5)
    assert int(out) == -1 and work.any()  # 2 of 5 blocks done: no count yet
    check(m8, p8, si[2:], di[2:], sums[2:], want[2:], work[3:], work[:1], out, 5)
    assert int(out) == 1 and not work.any() and torch.equal(sums, truth)


def test_the_fused_check_counts_once_and_leaves_its_workspace_zero() -> None:
    _fused_check_case(kernels.copy_sum_check_blocks_between, 40)


@interpreted
@pytest.mark.parametrize("words", [40, 4500])  # one program per block; three (tickets)
def test_the_triton_fused_check_counts_once_and_leaves_its_workspace_zero(words) -> None:
    from kernels.triton_copy_check import copy_sum_check_blocks_between

    _fused_check_case(copy_sum_check_blocks_between, words)


def test_the_fused_check_refuses_vectors_that_do_not_pair() -> None:
    pool = torch.zeros(4, 64, dtype=torch.uint8)
    sums, work, out = _check_args(2)
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="2 blocks need 2 sums"):
        kernels.copy_sum_check_blocks_between(
            pool, pool, idx, idx, sums[:1], sums, work[1:], work[:1], out
        )


def test_a_fetch_uploads_its_ids_and_sums_in_one_buffer_and_keeps_no_copy() -> None:
    """What `_copy_sum` stages (a CPU transport: the buffer is the upload): block ids, the
    sender's sums with their bits as int64, the zeroed sums the kernel adds to (the returned
    sums are a view of that one buffer), and the count's slot right behind them."""
    t, _ = _transport("")
    peer = torch.randint(0, 256, (8, 256), dtype=torch.uint8)
    src, dst = [5, 1, 6], [0, 7, 3]
    want = [*_wsum(peer, src)[:2], TOP]
    sums, count, staged = t._copy_sum(peer, src, dst, want)
    assert staged is not None and count is not None
    assert staged[:6].tolist() == src + dst and staged[6:9].tolist() == signed64(want)
    assert sums.data_ptr() == staged[9:].data_ptr() and count.data_ptr() == staged[12:].data_ptr()
    assert int(count) == 1


def test_the_suffix_fast_path_gives_what_the_lookup_gives() -> None:
    """The decode worker's fetch (a suffix of the handle's blocks) takes the handle's sums as
    they are; a block named twice with two sums, or a sum out of uint64 range, still goes
    through the lookup (None, or the masked value)."""
    assert sender_sums(handle(), IDS[2:]) == SUMS[2:]
    assert sender_sums(handle(), IDS) == SUMS
    twice = handle(ids=(7, 3, 9, 7, 5), sums=(1, 2, 3, 4, 5))
    assert sender_sums(twice, [9, 7, 5]) is None
    negative = handle(sums=(11, -5, 1 << 63, 0, 42))
    assert sender_sums(negative, IDS[1:]) == (TOP, 1 << 63, 0, 42)


def test_verify_matches_the_handles_sums_as_given_or_masked() -> None:
    checks = FetchChecks()
    checks.keep("r", Kept(None, 2, (1, TOP), 3))
    assert checks.take("r", (1, TOP)) == 3
    checks.keep("r", Kept(None, 2, (1, TOP), 3))
    assert checks.take("r", [1, -5]) == 3  # the same bits
    kept = Kept(None, 2, (1, TOP), 3)
    checks.keep("r", kept)
    assert checks.take("r", [1, 2]) is kept  # other sums: compared again


class FakeEvent:
    """A CUDA event that completes after ``polls`` queries or on ``synchronize``."""

    def __init__(self, polls: int, sync_s: float = 0.0) -> None:
        self.polls, self.sync_s, self.synced = polls, sync_s, 0

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        time.sleep(self.sync_s)
        self.synced += 1


def test_a_fetch_polls_as_long_as_its_copy_should_take_and_only_then_waits_in_a_thread() -> None:
    """`_wait`: a copy that completes within its expected time (its bytes at ``POLL_RATE``
    plus the margin) is polled on the loop, with no thread; one that outlasts it is waited for
    in a thread; the timeout counts from the wait's start and raises only after the copy
    ended (its destination is never freed under it)."""
    from libkv.transfer import KVTransferError, cuda_ipc

    t, _ = _transport("")
    ev = FakeEvent(polls=200)  # a few hundred microseconds of polls
    asyncio.run(t._wait(ev, 5.0, 512 << 20))  # 512 MiB: ~6 ms of polling allowed
    assert (t.thread_waits, ev.synced) == (0, 0)
    ev = FakeEvent(polls=10**9)
    start = time.monotonic()
    asyncio.run(t._wait(ev, 5.0, 0))  # nothing expected: the margin, then a thread
    assert (t.thread_waits, ev.synced) == (1, 1)
    assert time.monotonic() - start < 0.5
    ev = FakeEvent(polls=10**9, sync_s=0.3)
    with pytest.raises(KVTransferError, match="took over 0.1 s"):
        asyncio.run(t._wait(ev, 0.1, 10**12))  # polling capped by the timeout
    assert ev.synced == 2  # timed out in the thread, then waited for to the end
    assert cuda_ipc.POLL_MAX_S < 0.1  # so this one went to a thread first


INFO = {
    "device_uuid": "", "handle": "", "size": 0, "offset": 0, "ref_counter_handle": "",
    "ref_counter_offset": 0, "event_handle": "", "event_sync_required": False,
    "num_blocks": 12,
}  # fmt: skip


class _Done:
    def query(self) -> bool:
        return True

    def record(self, stream: object) -> None:
        pass


@pytest.mark.parametrize("fault", ["", "corrupt"])
def test_a_cpu_fetch_goes_through_the_one_wait_path(monkeypatch, fault) -> None:
    """`fetch` + `verify` end to end on CPU tensors (the stream and event of CUDA stubbed;
    on CUDA: ``tests/gpu/test_kv_checked_gpu.py``): the handle's sums go up with the ids, the
    count comes from the fetch's own kernel, verify answers it without device work, blocks
    land bit for bit, and concurrent fetches keep their own counts."""
    import contextlib

    from libkv.transfer.cuda_ipc import CudaIpcTransport

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda d: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Done)
    peer = torch.randint(0, 256, (12, 256), dtype=torch.uint8)
    mine = torch.zeros(12, 256, dtype=torch.uint8)
    t = CudaIpcTransport(mine, 256, None, sums=True, fault=fault)  # type: ignore[arg-type]
    t._mapped = lambda name, info: peer  # type: ignore[method-assign]
    t.can_reach = lambda extra: True  # type: ignore[method-assign]
    ids = [9, 1, 7, 2, 11]
    good = handle(ids=ids, sums=_wsum(peer, ids))
    sums = list(good.block_checksums)
    sums[3] ^= 1
    wrong = replace(good, block_checksums=tuple(sums))

    class Records:
        async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict:
            from libkv.transfer import CUDA_IPC_KEY

            return {CUDA_IPC_KEY: json.dumps({**INFO, "block_bytes": 256})}

    t.records = Records()  # type: ignore[assignment]

    async def go() -> list[int | None]:
        await asyncio.gather(
            t.fetch("a", good, ids[1:], [0, 3, 4, 5], 5.0),
            t.fetch("b", wrong, ids, [6, 7, 8, 10, 11], 5.0),
        )
        return [await t.verify("a", good.block_checksums[1:]),
                await t.verify("b", wrong.block_checksums)]  # fmt: skip

    damaged = 1 if fault else 0
    assert asyncio.run(go()) == [damaged, 1 + damaged]
    assert (t.fused_fetches, t.compared_fetches, t.device_verifies) == (2, 2, 0)
    assert torch.equal(mine[[3, 4, 5]], peer[[7, 2, 11]])
    assert torch.equal(mine[[7, 8, 10, 11]], peer[[1, 7, 2, 11]])
    assert torch.equal(mine[0], peer[1]) != bool(fault)
    assert not t._workspace(1).any()


@pytest.mark.parametrize("fault", ["", "corrupt"])
@pytest.mark.parametrize(
    "src,dst",
    [([2, 3, 4], [5, 6, 7]), ([0, 1, 6], [4, 5, 0]), ([5, 1, 6, 2], [0, 7, 3, 4])],
)
def test_a_fetch_of_a_few_runs_is_checked_with_nothing_uploaded(src, dst, fault) -> None:
    """`_copy_sum` on the runs path (`kernels.runs_copy_sum` then `kernels.compare_sums`; the
    torch references on CPU): the copy goes first, then the sender's sums are asked for (the
    function given, once) and go into the pinned buffer as they are (int64 bits), the count
    lands right behind them (the returned count is a view of it), no sums are kept, the copies
    are exact but for the one bit the fault hook flips in transit, the count is exact, and the
    reused sums buffer is left zero; the same pool's copy is bound once."""
    t, mine = _transport(fault)
    t.behind = True
    peer = _peer(9)
    before = peer.clone()
    n = len(src)
    for wrong in (None, n - 1):
        mine.zero_()
        want = _wsum(peer, src)
        if wrong is not None:
            want[wrong] ^= 1 << 63
        asked = []

        def sender(want=want, asked=asked):
            asked.append(bool(mine.any()))  # the copy was queued before (done, on CPU)
            return want

        sums, count, staged = t._copy_sum(peer, src, dst, sender)
        assert asked == [True] and sums is None and staged is not None
        assert staged[:n].tolist() == signed64(want)
        assert int(count) == int(staged[n]) == (wrong is not None) + (fault == "corrupt")
        assert (mine[dst] != peer[src]).sum().item() == (1 if fault else 0)
        assert torch.equal(peer, before)
        assert not t._sums_buffer(1).any()
    assert t.run_fetches == 2 and list(t._copiers) == [("runs", id(peer))] and not t._checkers


@pytest.mark.parametrize(
    "count,block_bytes,most,chunks",
    [
        (256, 2 << 20, 0, [88, 128, 32, 8]),  # a 4,096-token prompt of the 8B shape, no cap
        (128, 2 << 20, 0, [88, 32, 8]),
        (64, 2 << 20, 0, [24, 32, 8]),
        (8, 2 << 20, 0, [8]),
        (3, 2 << 20, 0, [3]),
        (7, 64 << 20, 0, [2, 4, 1]),  # blocks over the trail: one block at the end
        (256, 2 << 20, 64, [24] + [32] * 7 + [8]),  # 4,096 tokens, 64 MiB at most
        (128, 2 << 20, 64, [24, 32, 32, 32, 8]),
        (128, 2 << 20, 1, [8] + [8] * 14 + [8]),  # a cap under the trail: the trail's size
    ],
)
def test_a_run_from_another_gpu_is_cut_down_to_a_short_last_chunk(
    monkeypatch, count, block_bytes, most, chunks
) -> None:
    """Chunks grow from the last by the ratio, no larger than the cap (``most`` MiB, 0: none)."""
    from libkv.transfer.cuda_ipc_checks import TRAIL_BYTES, TRAIL_RATIO, peer_chunks

    monkeypatch.setattr(cuda_ipc_checks, "TRAIL_MAX_BYTES", most << 20)
    got = peer_chunks(count, block_bytes)
    assert [c for _, c in got] == chunks and sum(chunks) == count
    assert [o for o, _ in got] == [sum(chunks[:i]) for i in range(len(chunks))]
    assert got[-1][1] <= max(1, TRAIL_BYTES // block_bytes)
    assert all(a <= TRAIL_RATIO * b for a, b in itertools.pairwise(chunks))


def test_run_wsum64_adds_each_blocks_sum_into_its_slot() -> None:
    pool = torch.randint(0, 256, (8, 256), dtype=torch.uint8)
    sums = torch.zeros(6, dtype=torch.int64)
    run_sum = kernels.run_wsum64(pool, sums)
    run_sum(2, 3, 1)
    run_sum(7, 1, 5)
    assert [s & fetch_checks.MASK for s in sums.tolist()] == [
        0,
        *_wsum(pool, [2, 3, 4]),
        0,
        _wsum(pool, [7])[0],
    ]
    for args in ((6, 3, 0), (0, 2, 5), (-1, 1, 0)):
        with pytest.raises(ValueError):
            run_sum(*args)
    run_sum(0, 0, 6)  # nothing to sum: nothing done


@pytest.mark.parametrize("side", [0, 2], ids=["side-fast", "side-2-programs"])
@pytest.mark.parametrize("fault", ["", "corrupt"])
@pytest.mark.parametrize("src,dst", [([2, 3, 4], [5, 6, 7]), ([5, 1, 6, 2], [0, 7, 3, 4])])
def test_runs_from_another_gpu_are_copied_then_summed_where_they_landed(
    monkeypatch, src, dst, fault, side
) -> None:
    """`_copy_sum` of runs from another GPU (``remote``; the torch references and no streams
    on CPU): every chunk is copied, then summed in this pool (`kernels.run_wsum64`), the
    compare behind: the count exact with a wrong expected sum and with the fault hook's
    damaged first block (the peer's pool untouched), no sums kept, the reused sums zero, and
    no SM copy-and-sum bound."""

    monkeypatch.setattr(cuda_ipc_checks, "TRAIL_BYTES", 256)  # one-block chunks: several a run
    monkeypatch.setattr(cuda_ipc_checks, "SIDE_PER_SM", side)
    t, mine = _transport(fault)
    t.behind = True
    peer = _peer(3)
    before = peer.clone()
    n = len(src)
    for wrong in (None, 0, n - 1):
        mine.zero_()
        want = _wsum(peer, src)
        if wrong is not None:
            want[wrong] ^= 1 << 7
        sums, count, staged = t._copy_sum(peer, src, dst, want, remote=True)
        assert sums is None and staged is not None and staged[:n].tolist() == signed64(want)
        damaged = fault == "corrupt" and wrong != 0  # a wrong first sum already counts it
        assert int(count) == (wrong is not None) + damaged
        assert (mine[dst] != peer[src]).sum().item() == (1 if fault else 0)
        assert (mine[dst[0]] != peer[src[0]]).sum().item() == (1 if fault else 0)
        assert torch.equal(peer, before) and not t._sums_buffer(1).any()
    assert t.peer_run_fetches == 3 and t.run_fetches == 0
    # the side stream's sums and the last one's: one launcher each (one when both go fast)
    keys = {(f"landed{p}", id(t.pool)) for p in (side, 0)}
    assert set(t._copiers) == keys


def test_runs_from_another_gpu_without_the_senders_sums_keep_theirs_for_verify() -> None:
    t, mine = _transport("")
    t.behind = True
    peer = torch.randint(0, 256, (8, 256), dtype=torch.uint8)
    sums, count, _ = t._copy_sum(peer, [1, 2, 3], [4, 5, 6], lambda: None, remote=True)
    assert count is None and sums is not None and not t._sums_buffer(1).any()
    assert sums.tolist() == signed64(_wsum(peer, [1, 2, 3]))
    assert torch.equal(mine[[4, 5, 6]], peer[[1, 2, 3]])


def test_a_fetch_of_runs_without_the_senders_sums_keeps_the_copys_for_verify() -> None:
    """The runs path when the handle carries no sums: the copy's sums are kept (a copy of
    them; the reused buffer zeroed again) and `verify` compares them later."""
    t, mine = _transport("")
    t.behind = True
    peer = torch.randint(0, 256, (8, 256), dtype=torch.uint8)
    src, dst = [2, 3, 4], [5, 6, 7]
    sums, count, staged = t._copy_sum(peer, src, dst, lambda: None)
    assert count is None and sums is not None  # (the pinned buffer goes back after the wait)
    assert sums.tolist() == signed64(_wsum(peer, src)) and not t._sums_buffer(1).any()
    assert torch.equal(mine[dst], peer[src]) and t.run_fetches == 1


@pytest.mark.parametrize("fault", ["", "corrupt"])
def test_more_runs_than_one_launch_takes_upload_their_ids_and_compare_behind(fault) -> None:
    """Five runs: the ids go up (the same buffer then holds the sender's sums, asked for once
    the copy is queued, and the count behind them), the copy and sum by ids, the compare
    behind it: the count exact (with the fault hook's damaged first block), no sums kept,
    the reused sums zero."""
    t, mine = _transport(fault)
    t.behind = True
    peer = torch.randint(0, 256, (8, 256), dtype=torch.uint8)
    src, dst = [0, 2, 4, 6, 1], [1, 3, 5, 7, 0]
    want = _wsum(peer, src)
    want[4] ^= 1
    asked = []
    sums, count, staged = t._copy_sum(peer, src, dst, lambda: asked.append(1) or want)
    assert sums is None and asked == [1] and staged is not None
    assert int(count) == int(staged[15]) == 1 + (fault == "corrupt")
    assert staged[:10].tolist() == [*src, *dst] and staged[10:15].tolist() == signed64(want)
    assert (t.run_fetches, t.behind_fetches) == (0, 1) and not t._sums_buffer(1).any()
    assert (mine[dst] != peer[src]).sum().item() == (1 if fault else 0)
    assert list(t._copiers) == ([] if fault else [("packed", id(peer))])


def test_the_runs_copy_is_rebound_when_its_sums_grow_or_its_peer_is_unmapped() -> None:
    t, mine = _transport("")
    t.behind = True
    peer = torch.randint(0, 256, (8, 256), dtype=torch.uint8)
    bound = t._copier("runs", peer, 3)
    assert t._copier("runs", peer, 3) is bound
    t._sums_buffer(t._sums_buffer(1).numel() + 1)  # more blocks than it holds: a new buffer
    assert not t._copiers and t._copier("runs", peer, 3) is not bound
    t._peers["p0@i1"], t._peers["p0@i2"], t._current["p0"] = peer, mine, "p0@i1"
    t._mapped("p0@i2", None)  # type: ignore[arg-type]  # a new incarnation: the old unmapped
    assert not t._copiers


def test_verify_of_a_fetch_checked_as_runs_answers_its_count_or_leaves_it_to_the_caller() -> None:
    """A runs fetch keeps no sums: `verify` answers its count for the sums it compared, and
    None (the caller checks the blocks itself) for any other expected sums."""
    t, _ = _transport("")
    t._checks.keep("r", Kept(None, 2, (1, TOP), 1))
    assert asyncio.run(t.verify("r", (1, TOP))) == 1
    t._checks.keep("r", Kept(None, 2, (1, TOP), 0))
    assert asyncio.run(t.verify("r", (1, 2))) is None and t.device_verifies == 0
