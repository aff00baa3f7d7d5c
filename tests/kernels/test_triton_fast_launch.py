"""`kernels.triton_launch.FastLaunch` on any machine: the first launch of a variant goes through
``kernel[grid](...)`` and keeps the compiled kernel it returns, later ones call that kernel's
launcher directly with the runtime arguments and the current stream (Triton 3.6's calling
convention, as ``CompiledKernel.__getitem__`` calls it), a failure there is logged once and
every launch after it takes ``kernel[grid](...)``; under Triton's interpreter nothing is kept.
The direct launch on a GPU: ``tests/gpu/test_kv_checked_gpu.py``."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (PYTHONPATH=/tmp/triton-N)", allow_module_level=True)

from triton import knobs  # noqa: E402

from kernels.triton_launch import FastLaunch  # noqa: E402


class Compiled:
    """What ``kernel[grid](...)`` returns on a GPU: a CompiledKernel (its launcher records)."""

    function = 1234
    packed_metadata = (8, 1, 0)

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def run(self, *args):
        if self.fail:
            raise TypeError("another calling convention")
        self.calls.append(args)

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid, "stream": stream}


class Kernel:
    """A JIT function: ``kernel[grid](*args, **kw)`` records and returns ``compiled``."""

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.compiled

        return launch


@pytest.fixture
def cuda_state(monkeypatch):
    """The current device and stream as torch reports them on a GPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 777, raising=False)


def call(fl: FastLaunch, key, n: int) -> None:
    fl(
        key, (n, 3), lambda: (0xA000, 0xB000, n, 2048),
        lambda: (("src", "dst", n), {"CHUNK": 2048}), num_warps=8,
    )  # fmt: skip


def test_the_first_launch_compiles_the_next_go_straight_to_the_compiled_kernel(cuda_state):
    ck = Compiled()
    k = Kernel(ck)
    fl = FastLaunch(k, "test")
    call(fl, "v1", 5)
    assert k.launches == [((5, 3), ("src", "dst", 5), {"CHUNK": 2048, "num_warps": 8})]
    assert (fl.fast, fl.slow, ck.calls) == (0, 1, [])
    call(fl, "v1", 6)
    call(fl, "v1", 7)
    assert len(k.launches) == 1 and (fl.fast, fl.slow) == (2, 1)
    # grid x, y, z, the current stream, the function, its metadata, no launch metadata or
    # hooks (none registered), then every kernel argument, the constexpr included.
    assert ck.calls == [
        (6, 3, 1, 777, 1234, (8, 1, 0), None, None, None, 0xA000, 0xB000, 6, 2048),
        (7, 3, 1, 777, 1234, (8, 1, 0), None, None, None, 0xA000, 0xB000, 7, 2048),
    ]
    call(fl, "v2", 8)  # another variant: compiled (found) through kernel[grid] first
    assert len(k.launches) == 2 and (fl.fast, fl.slow) == (2, 2)


def test_registered_launch_hooks_still_see_every_direct_launch(cuda_state):
    ck = Compiled()
    fl = FastLaunch(Kernel(ck), "test")
    seen: list = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        call(fl, "v", 1)
        call(fl, "v", 2)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    (args,) = ck.calls
    assert args[6] == {"grid": (2, 3, 1), "stream": 777}
    assert args[7] is knobs.runtime.launch_enter_hook
    assert args[8] is knobs.runtime.launch_exit_hook


def test_a_failing_direct_launch_falls_back_for_good_and_says_so_once(cuda_state, caplog):
    ck = Compiled(fail=True)
    k = Kernel(ck)
    fl = FastLaunch(k, "the test kernel")
    with caplog.at_level(logging.WARNING, logger="kernels.triton_copy"):
        for n in range(1, 5):
            call(fl, "v", n)
    assert [g for g, _, _ in k.launches] == [(n, 3) for n in range(1, 5)]  # every one launched
    assert fl.broken and (fl.fast, fl.slow) == (0, 4)
    warnings = [r for r in caplog.records if "direct launch of the test kernel" in r.message]
    assert len(warnings) == 1 and "another calling convention" in warnings[0].message


def test_nothing_is_kept_when_kernel_grid_returns_no_compiled_kernel(cuda_state):
    k = Kernel(None)  # the interpreter's GridExecutor returns nothing
    fl = FastLaunch(k, "test")
    for n in range(3):
        call(fl, "v", n)
    assert len(k.launches) == 3 and (fl.fast, fl.slow, fl.compiled) == (0, 3, {})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="TRITON_INTERPRET=1")
def test_the_packed_check_runs_interpreted_through_kernel_grid_and_counts_exactly():
    """The transport's packed launch under the interpreter: the slices of the one upload, the
    count exact, the workspace zero, and no compiled kernel kept (every call interpreted)."""
    from kernels import reference, triton_copy_check

    g = torch.Generator().manual_seed(3)
    peer = torch.randint(0, 256, (6, 4096 * 8), dtype=torch.uint8, generator=g)  # 2 programs
    mine = torch.zeros_like(peer)
    src, dst = [4, 0, 5], [1, 3, 2]
    want = reference.block_wsum64(peer.view(torch.int64), torch.tensor(src)).tolist()
    want[1] ^= 1
    up = torch.tensor([*src, *dst, *want, 0, 0, 0], dtype=torch.int64)
    work = torch.zeros(4, dtype=torch.int64)
    out = torch.full((), -1, dtype=torch.int64)
    slow = triton_copy_check._CHECK.slow
    for _ in range(2):
        up[9:] = 0
        triton_copy_check.copy_sum_check_packed(mine, peer, up, 3, work, out, 3)
        assert int(out) == 1 and not work.any()
        assert torch.equal(mine[dst], peer[src])
    assert triton_copy_check._CHECK.slow == slow + 2 and triton_copy_check._CHECK.fast == 0
    assert not triton_copy_check._CHECK.compiled


def test_the_bound_packed_check_launches_the_same_variant_with_the_same_arguments(
    cuda_state, monkeypatch
):
    """`triton_copy_check.PackedCheck` (the transport's check bound to its pools once) goes
    straight to the variant `copy_sum_check_packed` compiled, with the very arguments that
    launch would pass (the upload's slices by address), and refuses what does not fit its
    workspace."""
    from kernels import triton_copy_check

    ck = Compiled()
    k = Kernel(ck)
    monkeypatch.setattr(triton_copy_check, "_CHECK", FastLaunch(k, "the check"))
    peer = torch.zeros(6, 4096 * 8, dtype=torch.uint8)
    mine = torch.zeros_like(peer)
    up = torch.zeros(13, dtype=torch.int64)
    work = torch.zeros(4, dtype=torch.int64)
    out = up[12]
    triton_copy_check.copy_sum_check_packed(mine, peer, up, 3, work, out, 3)  # compiles
    bound = triton_copy_check.PackedCheck(mine, peer, work)
    bound(up, 3, out)
    triton_copy_check.copy_sum_check_packed(mine, peer, up, 3, work, out, 3)
    assert len(k.launches) == 1 and triton_copy_check._CHECK.fast == 2
    assert ck.calls[0] == ck.calls[1]
    u = up.data_ptr()
    assert ck.calls[0][11:15] == (u, u + 24, u + 72, u + 48)  # ids, ids, sums, want
    bound(up[:9], 2, out, 7)  # two of seven blocks: its own ``total``
    assert ck.calls[2][0] == 2 and ck.calls[2][-3] == 7  # (..., total, per, CHUNK)
    with pytest.raises(ValueError):
        bound(up, 4, out)  # a workspace of 4 words checks 3 blocks at most


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="TRITON_INTERPRET=1")
def test_the_bound_packed_check_runs_interpreted_and_counts_exactly():
    """`triton_copy_check.PackedCheck` under the interpreter (through ``kernel[grid]``): the blocks
    copied, the count exact, the workspace left zero, twice in a row."""
    from kernels import reference, triton_copy_check

    g = torch.Generator().manual_seed(4)
    peer = torch.randint(0, 256, (6, 4096 * 8), dtype=torch.uint8, generator=g)  # 2 programs
    mine = torch.zeros_like(peer)
    src, dst = [2, 5, 0], [4, 1, 3]
    want = reference.block_wsum64(peer.view(torch.int64), torch.tensor(src)).tolist()
    want[2] ^= 1 << 62
    up = torch.tensor([*src, *dst, *want, 0, 0, 0], dtype=torch.int64)
    work = torch.zeros(4, dtype=torch.int64)
    out = torch.full((), -1, dtype=torch.int64)
    check = triton_copy_check.PackedCheck(mine, peer, work)
    for _ in range(2):
        up[9:] = 0
        check(up, 3, out)
        assert int(out) == 1 and not work.any()
        assert torch.equal(mine[dst], peer[src])


def test_split_gives_each_program_several_chunks_only_when_there_are_many(monkeypatch):
    """`triton_copy.split`: one chunk a program while a fetch has no more chunks than about
    ``PROGRAMS_PER_SM`` programs per SM; beyond, each program loops over several (never more
    than its block has), and the programs a block cover every chunk."""
    from kernels import triton_copy

    monkeypatch.setattr(triton_copy, "num_sms", lambda device: 132)
    monkeypatch.setattr(triton_copy, "PROGRAMS_PER_SM", 8)
    assert triton_copy.split(23, 64, 0) == (1, 23)  # 1,472 chunks: about 1,056 programs
    assert triton_copy.split(128, 256, 0) == (31, 5)  # 32,768 chunks
    assert triton_copy.split(128, 1, 0) == (1, 128)
    assert triton_copy.split(3, 10**6, 0) == (3, 1)  # never past the block
    for chunks, n in ((128, 64), (7, 500), (1000, 3)):
        per, progs = triton_copy.split(chunks, n, 0)
        assert per * progs >= chunks > per * (progs - 1)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="TRITON_INTERPRET=1")
@pytest.mark.parametrize("per_sm", [8, 4, 1])  # chunks a program: 1; 1 to 3 (some masked); all 3
@pytest.mark.parametrize("fault", [False, True])
@pytest.mark.parametrize(
    "runs",
    [[(2, 5, 3)], [(0, 1, 1), (4, 0, 1)], [(6, 2, 2), (0, 6, 1), (3, 0, 1), (9, 9, 1)]],
)
def test_the_runs_check_copies_counts_and_resets_interpreted_as_its_reference(
    runs, fault, per_sm, monkeypatch
):
    """`triton_copy.RunsCopySum` then `triton_copy.compare_sums` (nothing uploaded: the runs
    as scalars, the sender's sums read and the count written in host memory) under the
    interpreter, against `kernels.runs_copy_sum` and `kernels.compare_sums`'s torch
    references: the same blocks land (with the fault hook, the same one bit flipped in block
    0, in transit: the sender untouched), the count is exact, and the reused sums are left
    zero, call after call; with one chunk a program, or several in its loop
    (`triton_copy.split`; the interpreter counts as one SM)."""
    from kernels import compare_sums, reference, runs_copy_sum, triton_copy

    monkeypatch.setattr(triton_copy, "PROGRAMS_PER_SM", per_sm)

    g = torch.Generator().manual_seed(5)
    peer = torch.randint(0, 256, (10, 4096 * 8 + 8 * 8), dtype=torch.uint8, generator=g)
    before = peer.clone()  # 3 programs a block (the last one partial), odd words
    src = [s + i for s, _, k in runs for i in range(k)]
    dst = [d + i for _, d, k in runs for i in range(k)]
    n = len(src)
    want = reference.block_wsum64(peer.view(torch.int64), torch.tensor(src)).tolist()
    triton_sums = torch.zeros(n, dtype=torch.int64)  # reused across calls: left zero
    for wrong in range(n):
        host = torch.tensor([*want, -1], dtype=torch.int64)
        host[wrong] ^= 1 << 63
        outs = []
        for make, compare in ((triton_copy.RunsCopySum, triton_copy.compare_sums),
                              (runs_copy_sum, compare_sums)):  # fmt: skip
            mine = torch.zeros_like(peer)
            sums = triton_sums if make is triton_copy.RunsCopySum else torch.zeros(n).long()
            h = host.clone()
            make(mine, peer, sums, fault)(runs)
            compare(sums, h, n)
            assert not sums.any()
            assert torch.equal(peer, before)
            outs.append((mine, int(h[n])))
        (got, count), (ref, ref_count) = outs
        assert torch.equal(got, ref)
        assert (got[dst] != peer[src]).sum().item() == (1 if fault else 0)
        # the wrong sum, plus block 0 when its bit flipped (unless block 0 is the wrong one)
        assert count == ref_count == 1 + (fault and wrong != 0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="TRITON_INTERPRET=1")
@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 2500])
def test_the_compare_counts_across_its_steps_and_zeroes_the_sums_interpreted(n):
    """`triton_copy.compare_sums` (one program, ``COMPARE_BLOCK`` sums a step): the count of
    differing sums for any ``n`` (none, one step, several with a partial last), into
    ``host[n]``, nothing past ``n`` read or written, the sums zeroed."""
    from kernels import triton_copy

    g = torch.Generator().manual_seed(n)
    sums = torch.randint(-(2**62), 2**62, (n + 3,), dtype=torch.int64, generator=g)
    tail = sums[n:].clone()
    host = torch.cat([sums[:n].clone(), torch.tensor([-1, 7])])
    wrong = list(range(0, n, 97))
    for k in wrong:
        host[k] ^= 1 << 40
    triton_copy.compare_sums(sums, host, n)
    assert int(host[n]) == len(wrong) and int(host[n + 1]) == 7
    assert not sums[:n].any() and torch.equal(sums[n:], tail)


def test_run_scalars_name_each_programs_run_and_refuse_what_does_not_fit():
    from kernels.triton_copy import RUNS, run_scalars

    runs = [(6, 2, 2), (0, 6, 1), (3, 0, 1)]
    scalars, n = run_scalars(runs)
    a, b, e = scalars[:RUNS], scalars[RUNS : 2 * RUNS], scalars[2 * RUNS :]
    assert n == 4
    for i, (s, d) in enumerate([(6, 2), (7, 3), (0, 6), (3, 0)]):
        r = sum(i >= x for x in e)  # the kernel's pick
        assert (i + a[r], i + b[r]) == (s, d)
    for bad in ([], [(0, 0, 1)] * (RUNS + 1), [(0, 0, 0)]):
        with pytest.raises(ValueError):
            run_scalars(bad)
