"""Tests of libkv.hashing: the one prefix hash chain every process must agree on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from libkv.hashing import (
    HASH_BYTES,
    ROOT_HASH,
    encode_extra_keys,
    hash_block,
    hash_prefix_blocks,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS_8 = list(range(1, 9))

# Pinned once from the current scheme (sha256, u32le/i64le framing, seed b"tandem/kv/v1").
# If these change, every router, prefill and decode worker must change together: bump the seed.
PINNED_ROOT = "f3391045558fd0c458dd6833c2f4e131"
PINNED_CHAIN = ["f3d3b06d99d81d63f59e0802c26599dd", "4d9bdffaa7096c819a4fa4ca53330814"]
PINNED_CHAIN_ACME = ["0942460c24521c234da70526658ead7d", "58ff768297e2d41ee520301565e80166"]

CHILD_SCRIPT = (
    "from libkv.hashing import encode_extra_keys, hash_prefix_blocks;"
    "print(','.join(h.hex() for h in hash_prefix_blocks("
    "list(range(1, 9)), 4, encode_extra_keys('acme'))))"
)


def test_root_hash_is_pinned() -> None:
    assert ROOT_HASH.hex() == PINNED_ROOT
    assert len(ROOT_HASH) == HASH_BYTES == 16


def test_chain_matches_pinned_values() -> None:
    assert [h.hex() for h in hash_prefix_blocks(TOKENS_8, 4)] == PINNED_CHAIN
    acme = hash_prefix_blocks(TOKENS_8, 4, encode_extra_keys("acme"))
    assert [h.hex() for h in acme] == PINNED_CHAIN_ACME


def test_chain_is_deterministic_and_links_parents() -> None:
    first = hash_prefix_blocks(TOKENS_8, 4)
    assert first == hash_prefix_blocks(list(TOKENS_8), 4)
    assert first == hash_prefix_blocks(tuple(TOKENS_8), 4)
    h0 = hash_block(ROOT_HASH, TOKENS_8[:4])
    assert first == [h0, hash_block(h0, TOKENS_8[4:])]
    assert all(len(h) == HASH_BYTES for h in first)


@pytest.mark.parametrize("hashseed", ["0", "1", "12345"])
def test_chain_is_identical_across_processes(hashseed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.run(
        [sys.executable, "-c", CHILD_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        check=True,
        timeout=30,
    )
    assert child.stdout.strip().split(",") == PINNED_CHAIN_ACME


def test_parent_changes_the_hash() -> None:
    other_parent = hash_block(ROOT_HASH, [9, 9, 9, 9])
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) != hash_block(other_parent, [1, 2, 3, 4])
    # The same block after a different prefix gets a different hash.
    a = hash_prefix_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_prefix_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]


def test_tokens_change_the_hash() -> None:
    base = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert base != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert base != hash_block(ROOT_HASH, [4, 3, 2, 1])
    assert base != hash_block(ROOT_HASH, [1, 2, 3])
    # Length framing: trailing tokens cannot masquerade as extra keys or vice versa.
    assert hash_block(ROOT_HASH, [1, 2], b"") != hash_block(ROOT_HASH, [1], b"\x02" + b"\x00" * 7)
    assert hash_block(ROOT_HASH, [0]) != hash_block(ROOT_HASH, [0, 0])
    assert hash_block(ROOT_HASH, [-1]) != hash_block(ROOT_HASH, [2**63 - 1])


def test_extra_keys_change_the_hash() -> None:
    base = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert base == hash_block(ROOT_HASH, [1, 2, 3, 4], b"")
    assert base != hash_block(ROOT_HASH, [1, 2, 3, 4], b"x")
    assert hash_block(ROOT_HASH, [1, 2, 3, 4], b"x") != hash_block(ROOT_HASH, [1, 2, 3, 4], b"y")


def test_tenants_get_different_hashes() -> None:
    tenants = [None, "acme", "globex", "acme2"]
    extras = [encode_extra_keys(t) for t in tenants]
    assert len(set(extras)) == len(tenants)
    chains = [tuple(hash_prefix_blocks(TOKENS_8, 4, e)) for e in extras]
    assert len(set(chains)) == len(tenants)
    # Every block differs, not just the first one.
    assert len({c[1] for c in chains}) == len(tenants)


def test_encode_extra_keys() -> None:
    assert encode_extra_keys() == b""
    assert encode_extra_keys(None, None) == b""
    assert encode_extra_keys("") == b""  # an empty tenant is no tenant
    assert encode_extra_keys("acme") == b"tenant=acme\x00adapter="
    assert encode_extra_keys("acme") == encode_extra_keys("acme")
    # A tenant and an adapter of the same name are different keys.
    assert encode_extra_keys(tenant="x") != encode_extra_keys(adapter="x")
    assert encode_extra_keys("acme", "lora1") != encode_extra_keys("acme")
    assert encode_extra_keys("\u00e9t\u00e9") == "tenant=\u00e9t\u00e9\x00adapter=".encode()


@pytest.mark.parametrize(
    ("n_tokens", "n_hashes"), [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (11, 2), (12, 3)]
)
def test_only_full_blocks_are_hashed(n_tokens: int, n_hashes: int) -> None:
    tokens = list(range(100, 100 + n_tokens))
    hashes = hash_prefix_blocks(tokens, 4)
    assert len(hashes) == n_hashes
    # A trailing partial block never changes the hashes of the full ones.
    assert hashes == hash_prefix_blocks(tokens[: n_hashes * 4], 4)


def test_custom_parent_continues_a_chain() -> None:
    full = hash_prefix_blocks(list(range(12)), 4)
    tail = hash_prefix_blocks(list(range(4, 12)), 4, parent=full[0])
    assert tail == full[1:]
