"""The CUDA IPC hand-off's check behind the copy, off the GPU: which of the handle's sums belong
to the fetched blocks (`libkv.transfer.fetch_checks`), what `verify` answers from what a fetch
kept, the compare-and-count step (``kernels.count_mismatches``: torch reference, and the
Triton kernel under ``TRITON_INTERPRET=1``), and the transport's fused copy with the compare
on CPU tensors (the same dispatch as on a GPU). On CUDA: ``tests/test_kv_checked_gpu.py``."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch

import kernels
from engine.kv_checksum import WSUM64, legacy_algorithm
from kernels import reference
from libkv.transfer import fetch_checks
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
    sums, bad = t._copy_sum(peer, src, dst, want)
    assert bad is not None and int(bad) == (1 if fault else 0)
    assert torch.equal(sums, torch.tensor(signed64(_wsum(mine, dst))))  # what landed
    want[2] ^= 1 << 63  # a sender's sum that no block matches
    _, bad = t._copy_sum(peer, src, dst, want)
    assert bad is not None and int(bad) == (2 if fault else 1)


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


def test_the_check_bench_runs_dry(tmp_path, capsys) -> None:
    """``bench.kv_checksum --dry-run`` runs the A/B of the check's kernel arms on the torch
    references (the transport's arms need CUDA: ``tests/test_kv_checked_gpu.py``)."""
    import json

    from bench import kv_checksum

    assert kv_checksum.main(["--dry-run", "--stack-handoff-ms", "2.5", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "kv_checksum_cpu_wsum64.json").read_text())
    assert [r["tokens"] for r in rows] == [40, 100]
    ab = rows[0]["ab_kernels"]
    assert ab["pairs"] == 6 and ab["stack_handoff_ms"] == 2.5 and ab["a_ms"] > 0
    assert "ab_transport" not in rows[0]
    assert "of 2.5 ms" in capsys.readouterr().out
