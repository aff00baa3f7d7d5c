"""Checked KV: every block a prefill worker hands off carries a checksum computed where the
pool lives; the decode worker checks what arrived and recomputes the prompt on a mismatch,
counting the corrupt blocks, so corrupt KV is never served. Unit tests of the checksum and one
stack whose decode worker damages every transfer (the test-only ``--kv-fault corrupt``)."""

from __future__ import annotations

import urllib.request

import openai
import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.kv_checksum import MASK, BlockChecksums
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.test_e2e_stack import LONG, MODEL, assert_all_free, offline_greedy


@pytest.mark.parametrize("weighted", [False, True], ids=["crc32", "weighted-sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_changed_word_changes_the_checksum(dtype, weighted) -> None:
    """Both functions (CRC-32 for host pools, the odd-weighted sum for GPU pools)."""
    torch.manual_seed(0)
    cache = torch.randn(6, 2, 2, 16, 2, 8).to(dtype)
    sums = BlockChecksums(cache, weighted)
    cache[3] = cache[1]  # same bytes in another block: same checksum
    base = sums([0, 1, 2, 3])
    assert base[1] == base[3] and len(set(base[:3])) == 3
    assert all(0 <= s <= MASK for s in base)
    words = cache.view(-1).view(torch.int64).view(6, -1)
    for pos in (0, 7, words.shape[1] - 1):  # one flipped bit anywhere, the top one included
        for bit in (0, 63):
            saved = int(words[2, pos])
            words[2, pos] ^= -(1 << 63) if bit == 63 else 1
            assert sums([2]) != [base[2]], (pos, bit)
            words[2, pos] = saved
    assert sums([2]) == [base[2]]
    swapped = words[2].clone()
    words[2, 0], words[2, 1] = swapped[1], swapped[0]  # two words trade places
    assert sums([2]) != [base[2]] or bool(swapped[0] == swapped[1])
    before = sums([5])
    cache[5].zero_()  # what an incomplete transfer leaves
    assert sums([5]) != before


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory):
    config = StackConfig(
        model_dir=str(smol_dir), run_dir=str(tmp_path_factory.mktemp("checked")),
        port=free_port(), num_prefill=1, num_decode=1, kv_transport="grpc",
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
    assert decode_metric(stack, "tandem_kv_transfer_corrupt_blocks_total") == before + 1
    assert decode_metric(stack, "tandem_kv_handoff_recomputed_total") >= 1
    log = stack.children["decode-0"].log_path.read_text()
    assert "arrived corrupt; recomputing it here" in log
    assert_all_free(stack, within=10)
