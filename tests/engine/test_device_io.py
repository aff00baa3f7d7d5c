"""Uploads for the step loop: several index lists in one copy, each view 16-byte aligned (a
misaligned pointer makes Triton compile a kernel variant the warm-up did not)."""

from __future__ import annotations

import torch

from engine.device_io import upload_many


def test_every_part_is_its_values_and_starts_16_byte_aligned() -> None:
    parts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [], [10, 11]]
    out = upload_many(parts, torch.device("cpu"))
    assert [t.tolist() for t in out] == parts
    assert all(t.data_ptr() % 16 == 0 for t in out)
    assert all(t.is_contiguous() and t.dtype == torch.int64 for t in out)
