"""The serving stack on one GPU (``pytest -m gpu``; run on a GPU host, e.g. with
``bash bench/device/run.sh tests``): workers placed on the device with their own memory
shares, the KV hand-off between two workers of one GPU over CUDA IPC, the OpenAI client
against it, and greedy output identical through the disaggregated path, the colocated path and
the in-process engine. Models are ``engine.shapes`` folders with dummy weights (seeded, so
every worker of one GPU type draws the same ones)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from openai import OpenAI  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bundled import DEFAULT_DIR  # noqa: E402
from engine.shapes import write_shape  # noqa: E402
from services.launcher.etcd import free_port  # noqa: E402
from services.launcher.stack import Stack, StackConfig  # noqa: E402

TOKENIZER = Path(os.environ.get("TANDEM_TOKENIZER_DIR", DEFAULT_DIR))
MODEL = "model"  # the served name: the folder's name
WORDS = "the quick brown fox jumps over a lazy dog while seven bold wizards quietly hex"
# Engine options shared by every path, so that chunking and graph sizes match exactly.
ENGINE = dict(max_num_batched_tokens=512, max_model_len=2048, max_num_seqs=16)


def shape_dir(tmp_path_factory, name: str) -> Path:
    return write_shape(name, tmp_path_factory.mktemp(name) / MODEL, TOKENIZER)


def config(model_dir: Path, run_dir: Path, **kw) -> StackConfig:
    base = dict(
        model_dir=str(model_dir),
        run_dir=str(run_dir),
        port=free_port(),
        gpus=("0",),
        load_format="dummy",
        decode_only_threshold=16,
        disagg_mode="length",
        start_timeout=300.0,
        **ENGINE,
    )
    return StackConfig(**{**base, **kw})


def prompt(i: int, words: int) -> str:
    vocab = WORDS.split()
    return " ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(words))


def metrics(stack: Stack, name: str) -> dict[tuple[str, tuple], float]:
    address = stack.scrape_targets()[name]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(values: dict, name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in values.items() if n == name and labels.items() <= dict(ls).items()
    )


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> Path:
    return shape_dir(tmp_path_factory, "smollm2-135m")


@pytest.fixture(scope="module")
def disagg(smol, tmp_path_factory):
    run = tmp_path_factory.mktemp("disagg")
    with Stack(config(smol, run, gpu_memory_utilization=0.2)) as stack:
        yield stack


def test_placement_gives_each_worker_the_gpu_and_its_share(disagg):
    for name in ("prefill-0", "decode-0"):
        child = disagg.children[name]
        assert child.env["CUDA_VISIBLE_DEVICES"].split(",")[0] == "0"
        assert "--gpu-memory-utilization" in child.argv
        log = child.log_path.read_text()
        assert "KV pool:" in log and "share of" in log, log[-2000:]


def test_openai_client_on_one_gpu_with_two_workers(disagg):
    client = OpenAI(base_url=disagg.url + "/v1", api_key="unused")
    long = prompt(0, 120)  # over the decode-only threshold: prefilled by the prefill worker
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=12,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 12
    done = client.completions.create(model=MODEL, prompt=long, max_tokens=8, temperature=0)
    assert done.choices[0].text and done.usage.prompt_tokens > 16
    # Echo with logprobs: the prompt's logprobs from the scoring pass on a GPU worker, the
    # generated token's from the decode worker's sampler; greedy, so it is the top-1 there.
    scored = client.completions.create(
        model=MODEL, prompt=long, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(long)
    assert len(lp.token_logprobs) == scored.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-3)


def _via_stack(stack: Stack, prompts: list[str], max_tokens: int) -> list[str]:
    client = OpenAI(base_url=stack.url + "/v1", api_key="unused")
    out = []
    for p in prompts:  # one at a time: every path runs the same batch shapes
        r = client.completions.create(
            model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        out.append(r.choices[0].text)
    return out


def test_greedy_identical_disaggregated_colocated_and_in_process(disagg, smol, tmp_path):
    prompts = [prompt(i, 60 + 37 * i) for i in range(4)]
    disaggregated = _via_stack(disagg, prompts, 24)
    with Stack(config(smol, tmp_path, num_prefill=0, gpu_memory_utilization=0.2,
                      decode_only_threshold=1 << 30)) as colocated:  # fmt: skip
        together = _via_stack(colocated, prompts, 24)
    llm = LLM(smol, load_format="dummy", gpu_memory_utilization=0.1, **ENGINE)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    in_process = [llm.generate(p, params)[0].text for p in prompts]
    del llm
    torch.cuda.empty_cache()
    assert disaggregated == together == in_process
    # ... and the disaggregated stack really handed the prompts over.
    m = metrics(disagg, "decode-0")
    assert sample(m, "tandem_kv_transfers_total", transport="cuda-ipc") >= len(prompts)


def test_decode_metrics_show_gpu_direct_handoff(disagg):
    _via_stack(disagg, [prompt(9, 200)], 4)
    m = metrics(disagg, "decode-0")
    assert sample(m, "tandem_kv_transfers_total", transport="cuda-ipc") > 0
    assert sample(m, "tandem_kv_transfer_bytes_total", transport="cuda-ipc") > 0
    assert sample(m, "tandem_kv_transfer_failures_total") == 0
    assert sample(m, "tandem_kv_handoff_recomputed_total") == 0
    assert sample(m, "tandem_kv_transfers_total", transport="grpc") == 0
    assert sample(m, "tandem_kv_gpu_direct", path="cuda-ipc") == 1
    # Checked by the sums the CUDA IPC copy took (no second read of the blocks), all clean.
    assert sample(m, "tandem_kv_transfer_fused_checks_total") > 0
    assert sample(m, "tandem_kv_transfer_corrupt_blocks_total") == 0


def test_a_block_corrupted_on_the_cuda_ipc_path_is_caught_and_recomputed(smol, tmp_path):
    """``--kv-fault corrupt`` over CUDA IPC flips one bit of each hand-off's first block in
    transit (what the fused copy reads); the decode worker's device-side compare catches it,
    recomputes the prompt and serves the in-process engine's greedy text (which every path
    matches, `test_greedy_identical_disaggregated_colocated_and_in_process`)."""
    p = prompt(5, 150)
    llm = LLM(smol, load_format="dummy", gpu_memory_utilization=0.1, **ENGINE)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    clean = [llm.generate(p, params)[0].text]
    del llm
    torch.cuda.empty_cache()
    with Stack(config(smol, tmp_path, gpu_memory_utilization=0.2,
                      worker_args=("--kv-fault", "corrupt"))) as stack:  # fmt: skip
        got = _via_stack(stack, [p], 12)
        m = metrics(stack, "decode-0")
        log = stack.children["decode-0"].log_path.read_text()
    assert got == clean
    moved = sample(m, "tandem_kv_transfers_total", transport="cuda-ipc")
    assert moved >= 1
    assert sample(m, "tandem_kv_transfer_fused_checks_total") == moved
    # Exactly the damaged block of each hand-off: the others match the sender's sums.
    assert sample(m, "tandem_kv_transfer_corrupt_blocks_total") == moved
    assert sample(m, "tandem_kv_handoff_recomputed_total") >= 1
    assert "arrived corrupt; recomputing it here" in log


def test_worker_refuses_a_share_too_small_with_the_numbers(tmp_path_factory):
    model = shape_dir(tmp_path_factory, "llama-3.1-8b")
    proc = subprocess.run(
        [sys.executable, "-m", "services.prefill", "--model-dir", str(model),
         "--load-format", "dummy", "--gpu-memory-utilization", "0.1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--gpu-memory-utilization 0.1 of" in proc.stderr and "GiB" in proc.stderr
    assert "Traceback" not in proc.stderr.splitlines()[-1]


def test_nixl_on_one_gpu_is_caught_as_slow_and_routers_stop_pairing(smol, tmp_path):
    """Without CUDA IPC, two workers of one GPU only have NIXL, whose UCX moves GPU memory
    between them at ~0.6 GB/s: the first hand-off (correct, but slow) turns NIXL off for GPU
    memory on the decode worker, which says so in its record; routers then serve the rest
    decode-only, and every request succeeds."""
    cfg = config(
        smol, tmp_path, gpu_memory_utilization=0.2, kv_transport="nixl",
        worker_args=("--no-cuda-ipc",), member_ttl=3, member_refresh=1.0,
    )  # fmt: skip
    with Stack(cfg) as stack:
        client = OpenAI(base_url=stack.url + "/v1", api_key="unused")

        def ask(i: int) -> str:
            r = client.completions.create(
                model=MODEL, prompt=prompt(i, 400), max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.choices[0].text

        assert ask(0)
        m = metrics(stack, "decode-0")
        if sample(m, "tandem_kv_gpu_direct", path="network") == 1:  # UCX found a fast path
            assert sample(m, "tandem_kv_slow_transfers_total") == 0
            return
        assert sample(m, "tandem_kv_slow_transfers_total") == 1
        assert sample(m, "tandem_kv_handoff_recomputed_total") == 0  # the data did arrive
        time.sleep(3)  # the record's change reaches the router within a refresh
        for i in range(1, 5):
            assert ask(i)
        after = metrics(stack, "decode-0")
        assert sample(after, "tandem_kv_transfers_total", transport="nixl-read") == 1
        assert sample(after, "tandem_kv_slow_transfers_total") == 1
