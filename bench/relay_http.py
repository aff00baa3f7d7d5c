"""The HTTP client side of ``bench.router_relay --gateway``: OpenAI streaming chat requests to a
real gateway process (``bench.sse_client``, the client ``tandem bench`` uses), with the
stand-in's tokens real ones of the model (`token_script`), so every chunk's text is checked
against the text the stream must carry and the tokens a chunk delivered are counted from it
(a gateway that coalesces tokens sends fewer chunks, the same text)."""

from __future__ import annotations

import bisect
import itertools
import time
from itertools import accumulate

from bench.relay_client import Probe, Streams, Tally
from bench.relay_worker import StandInState
from bench.sse_client import APIStatusError, StreamClient
from bench.words import WORDS

_ids = itertools.count()


def token_script(model_dir: str, n: int = 512) -> list[tuple[int, str]]:
    """``n`` (token id, text) pairs of English text as the model's tokenizer splits it, each
    text the token's own piece of the decoded whole (what a detokenizing worker sends)."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    words = [WORDS[i * 7 % len(WORDS)] + ("," if i % 9 == 8 else "") for i in range(n)]
    text = " " + " ".join(words)
    ids = tok.encode(text)[:n]
    texts, prev = [], ""
    for i in range(len(ids)):
        whole = tok.decode(ids[: i + 1], skip_special_tokens=False)
        texts.append(whole[len(prev) :])
        prev = whole
    if any(not t or "\ufffd" in t for t in texts):
        raise ValueError("the script has a token with no text of its own")
    return list(zip(ids, texts, strict=True))


class HttpClient(Streams):
    """Streams and probes through a gateway at ``base_url`` (ending in ``/v1``); the same
    `Tally` as `bench.relay_client.Client`, its ``events`` counting chunks with text."""

    def __init__(
        self, base_url: str, model: str, tokens: int, prompt_words: int,
        script: list[tuple[int, str]],
    ) -> None:  # fmt: skip
        self.http = StreamClient(base_url, "none", timeout=600)
        self.model, self.tokens = model, tokens
        self.prompt = " ".join(WORDS[i % len(WORDS)] for i in range(prompt_words))
        texts = [script[i % len(script)][1] for i in range(tokens)]
        self.expected = "".join(texts)
        self.ends = list(accumulate(len(t) for t in texts))  # text offset after each token
        self.tally = Tally()

    def body(self, max_tokens: int) -> dict:
        return {
            "model": self.model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": self.prompt}],
        }  # fmt: skip

    async def one_stream(self) -> None:
        """Run one stream of ``tokens`` tokens to its end, checking its text and usage."""
        t = self.tally
        rid = f"stream-{next(_ids)}"
        got, done, last = [], 0, 0.0  # done: tokens whose text arrived whole
        usage = None
        try:
            async for chunk in self.http.stream("/chat/completions", self.body(self.tokens)):
                usage = chunk.get("usage") or usage
                text = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if not text:
                    continue
                now = time.perf_counter()
                got.append(text)
                size = self.ends[done - 1] if done else 0
                size += len(text)
                n = bisect.bisect_right(self.ends, size) - done
                if t.counting:
                    t.events += 1
                    t.tokens += n
                    if done:
                        t.gaps_s.append(now - last)
                last, done = now, done + n
        except (APIStatusError, OSError, TimeoutError) as e:
            t.stream_errors.append(f"{rid}: {type(e).__name__} {e}")
            return
        text = "".join(got)
        if text == self.expected and usage and usage["completion_tokens"] == self.tokens:
            t.streams_done += 1
        elif len(t.order_errors) < 20:
            t.order_errors.append(f"{rid}: {len(text)} chars (of {len(self.expected)}), {usage}")

    async def probe(self, state: StandInState) -> Probe:
        """One 1-token request (the stand-in times requests for one token as probes)."""
        sent = time.monotonic()
        first = 0.0
        async for _ in self.http.stream("/chat/completions", self.body(1)):
            first = first or time.monotonic()  # the role chunk: sent with the first token
        _, timing = state.timings.popitem()  # probes run one at a time
        return Probe(first - sent, timing.arrived - sent, first - timing.first_sent)

    async def close(self) -> None:
        await self.http.close()
