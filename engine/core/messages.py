"""What crosses between a worker and its engine core: commands in, one message per step out.

The engine core (``engine.core.loop``) runs in its own process (``engine.core.process``) or, for
tests and tools, on a thread of the caller's (``engine.core.client.EngineClient.local``); the
same messages cross either way, pickled over a pipe or handed over in memory. Outputs cross as
deltas (the tokens, text and logprobs a step added), never as whole token lists, so a step's
message stays small whatever the context length. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams, TokenLogprob
from libkv.kv_layout import KVLayout


@dataclass(frozen=True, slots=True)
class PoolShare:
    """How another process maps the engine's KV pool: a host pool lives in a memfd, read
    through ``/proc/<pid>/fd/<fd>``; a GPU pool is exported for CUDA IPC (``ipc``: the
    ``libkv.transfer.cuda_ipc.IpcPool`` JSON). ``shape`` and ``dtype`` are the pool tensor's."""

    pid: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    fd: int = -1
    ipc: str = ""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Facts about a started engine that do not change while it runs."""

    layout: KVLayout
    block_size: int
    num_blocks: int
    block_bytes: int  # bytes of one block of this process's pool (rank 0's heads)
    dtype: str  # the model's dtype ("bfloat16")
    device: str  # "cpu", "cuda:0"
    checksum_algorithm: str
    max_model_len: int
    tensor_parallel_size: int
    enable_lora: bool
    pool: PoolShare | None
    pid: int
    host_blocks: int = 0  # blocks of the host tier (0: none)

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]


@dataclass(frozen=True, slots=True)
class Handoff:
    """A prefill's held KV, as the engine reports it with the request's last first-token
    output: its blocks in token order, their checksums (when asked), and each choice's seeded
    generator state (b"" when unseeded or finished)."""

    block_ids: tuple[int, ...]
    checksums: tuple[int, ...]
    checksum_algorithm: str
    generator_states: tuple[bytes, ...]


@dataclass(slots=True)
class Delta:
    """What one step added to one choice of a request (``engine.llm_engine.RequestOutput``
    minus its cumulative fields, which the client keeps)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    kv_held: bool = False
    others_pending: bool = False
    handoff: Handoff | None = None


@dataclass(slots=True)
class Snapshot:
    """The engine's counters as of a step (``EngineStats``) and its held requests."""

    stats: Any  # engine.llm_engine.EngineStats
    num_held: int


@dataclass(slots=True)
class StepMessage:
    """Everything one step (or an idle flush) produced: outputs in order, the prefix-cache
    events since the last message (``("cached", index, hash, parent)`` or
    ``("evicted", hash)``), the step's stats for metrics, and a fresh snapshot."""

    deltas: list[Delta] = field(default_factory=list)
    cache_events: list[tuple] = field(default_factory=list)
    steps: list[Any] = field(default_factory=list)  # engine.step_stats.StepStats
    snapshot: Snapshot | None = None


# -- commands (client -> engine) -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Add:
    """Queue a request (``LLMEngine.add_request``); ``handoff_sums``: a prefill's handoff
    carries its blocks' checksums."""

    call_id: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tenant: str | None = None
    hold_kv: bool = False
    priority: int = 0
    lora: str | None = None
    handoff_sums: bool = False


@dataclass(frozen=True, slots=True)
class Call:
    """Run one of the engine's methods (``engine.core.loop.CALLS``) between two steps."""

    call_id: int
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RankCall:
    """Run ``fn(context, *args)`` in tensor-parallel rank ``rank``'s process, off its steps
    (``engine.parallel.rpc``): the KV side of each rank's shard."""

    call_id: int
    rank: int
    fn: Any
    args: tuple = ()


@dataclass(frozen=True, slots=True)
class Listen:
    """Forward prefix-cache events (cached / evicted blocks) with each step from now on."""

    on: bool


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop (and the engine's ranks)."""


# -- replies (engine -> client) -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reply:
    """The result of a command with a ``call_id``: ``value`` or, when not ``ok``, the
    exception it raised."""

    call_id: int
    ok: bool
    value: Any = None


@dataclass(frozen=True, slots=True)
class Failure:
    """A step raised: every request live in the engine was aborted."""

    message: str


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is built (and warmed up); sent once, first."""

    info: EngineInfo


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The engine could not be built; ``message`` says why (no traceback for known causes)."""

    message: str
