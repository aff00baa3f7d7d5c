"""``--stream-interval`` end to end (etcd, a router, one colocated worker, the gateway; the bundled
model): a streamed completion reaches the client in messages of the interval's tokens (the first
token alone, then groups of 4, the rest last), each SSE chunk one message (its logprobs count its
tokens), with the same tokens and text as the whole completion."""

from __future__ import annotations

import json

import httpx
import pytest

from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack.test_e2e_stack import MODEL

INTERVAL = 4
TOKENS = 15
PROMPT = list(range(1000, 1012))


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory):
    config = StackConfig.colocated(
        1, model_dir=str(smol_dir), run_dir=str(tmp_path_factory.mktemp("interval")),
        port=free_port(), worker_args=("--stream-interval", str(INTERVAL)),
    )  # fmt: skip
    with Stack(config) as s:
        yield s


def test_a_stream_comes_in_messages_of_the_interval(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}  # fmt: skip
    whole = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    expected = whole.json()["choices"][0]
    sizes, text = [], ""
    with httpx.stream(
        "POST", f"{stack.url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                tokens = (choice.get("logprobs") or {}).get("tokens") or []
                if tokens:
                    sizes.append(len(tokens))
                text += choice.get("text") or ""
    assert sum(sizes) == TOKENS and text == expected["text"]
    # the first token alone, then messages of at least the interval (a lagging reader's
    # merges only make them larger), the last one whatever is left
    assert sizes[0] == 1, sizes
    assert all(n >= INTERVAL for n in sizes[1:-1]), sizes
    assert len(sizes) <= 1 + -(-(TOKENS - 1) // INTERVAL), sizes
