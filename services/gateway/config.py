"""The gateway's frozen config: every option declared once (`services.common.options`), parsed
once by `parse_config`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from engine.config import ModelConfig
from services.common.admission import batch_fraction_option, refusal_memory_option
from services.common.models import parse_models
from services.common.options import Options, option
from services.common.process import log_level_option
from services.common.tls import TLSFiles, TLSOptions
from services.gateway.keys import ApiKey, load_keys_file, plain_keys
from services.gateway.slo import check_ms
from services.gateway.tools import TOOL_CALL_PARSER_CHOICES
from services.observability.config import ObservabilityConfig


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The gateway's settings.

    ``max_tokens`` omitted in a request means ``min(max_model_len - prompt_len,
    default_max_tokens)``: as much as fits, but bounded so a forgotten limit cannot hold a decode
    slot for the whole context. Admission books such a request for only
    ``min(that, default_booked_tokens)`` completion tokens per choice (0: all of them), since
    most answers end long before the cap; it may still run to the cap, and once started it is
    never refused or cut for outgrowing its booking. ``api_keys`` holds hashed keys with their
    tenants and limits (``services.gateway.keys``; ``--api-key`` and the ``--api-keys-file``
    entries); empty disables auth. ``max_inflight_tokens`` bounds the tokens (prompt + booked)
    of the requests in flight here (0: unbounded), batch ones to ``batch_admission_fraction`` of
    it. A request's deadline is its ``timeout`` field, else ``request_timeout``, at most
    ``max_request_timeout`` seconds. ``tls`` (cert, key, CA) is the gateway's identity towards
    the routers (mutual TLS); ``ssl_certfile``/``ssl_keyfile`` serve HTTPS to clients.
    ``tool_call_parser`` and ``tool_chat_template`` choose how tools reach the model and how
    its calls are read (``services.gateway.tools``).
    """

    model_dir: str = option(
        "", "model folder: tokenizer and config.json", required=True, convert=os.path.expanduser
    )
    served_model_name: str = option("", "model id clients send (default: the folder's name)")
    extra_models: tuple[str, ...] = option(
        (),
        "another base model served beside --model-dir, DIR or NAME=DIR (repeatable; its "
        "context is the model's own); requests pick one by model, through the same routers",
        flag="--extra-model",
        metavar="[NAME=]DIR",
    )
    max_model_len: int = option(
        0,
        "context length (default: the model's); with several base models it caps each one, "
        "whose own context is used where it is shorter",
    )
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "HTTP port")
    routers: tuple[str, ...] = option(
        (), "router host:port; repeatable", flag="--router", old_env=("TANDEM_ROUTERS",)
    )
    api_keys: tuple[ApiKey, ...] = option(
        (),
        "API key clients present, key or key:tenant (a bare key's tenant is a short hash of "
        "it); repeatable. Only SHA-256 hashes are kept",
        flag="--api-key",
        old_env=("TANDEM_API_KEYS",),
        raw="tuple",
        convert=plain_keys,
    )
    api_keys_file: str = option(
        "",
        "JSON file of SHA-256 hashed API keys with tenants and rate limits "
        "(python -m services.gateway.keys KEY prints an entry)",
    )
    max_body_bytes: int = option(4 * 1024 * 1024, "largest request body (413 beyond)")
    default_max_tokens: int = option(4096, "cap on max_tokens when a request omits it")
    default_booked_tokens: int = option(
        1024,
        "completion tokens per choice that admission books (gateway, routers, decode workers) "
        "for a request that omits max_tokens; it may still run to --default-max-tokens, and "
        "once started is never refused or cut for that; 0 = book the whole cap",
    )
    log_level: str = log_level_option()
    slo_ttft_ms: float = option(
        1000.0,
        "default TTFT objective of a request (ms), unless its tenant or the request sets one "
        "(services.gateway.slo); the router places its prefill to meet it, and goodput counts "
        "requests within both objectives",
    )
    slo_tpot_ms: float = option(50.0, "default TPOT objective of a request (ms), as --slo-ttft-ms")
    observability: ObservabilityConfig = ObservabilityConfig()
    max_inflight_tokens: int = option(
        1_000_000,
        "answer 429 once the requests in flight hold this many tokens (prompt + max_tokens, "
        "or + --default-booked-tokens where max_tokens is omitted); "
        "0 = no bound",
    )
    batch_admission_fraction: float = batch_fraction_option()
    refusal_memory: float = refusal_memory_option("router")
    tokenizer_threads: int = option(
        2,
        "requests templated and tokenized at once, in worker threads, the rest waiting in "
        "arrival order (so under a burst each request reaches the routers, or a 429, soon "
        "instead of all at the end); more helps only when tokenizing is the bottleneck",
    )
    request_timeout: float = option(
        600.0, "deadline in seconds of a request that gives no 'timeout' field"
    )
    max_request_timeout: float = option(
        3600.0, "the largest 'timeout' a client may ask for (larger ones are cut to it)"
    )
    mtls: TLSOptions = TLSOptions()
    ssl_certfile: str = option("", "serve HTTPS with this certificate chain")
    ssl_keyfile: str = option("", "private key of --ssl-certfile")
    router_api_key: str = option(
        "", "key the gateway presents to routers started with --api-key", secret=True
    )
    token_path: str = option(
        "direct",
        "direct: the router picks the workers and the gateway streams tokens from the decode "
        "worker itself (one hop); relay: the router relays every token (two hops)",
        choices=("direct", "relay"),
    )
    tool_call_parser: str = option(
        "auto",
        "format of tool calls in the model's output (auto: chosen by model; none: tools refused)",
        choices=TOOL_CALL_PARSER_CHOICES,
    )
    tool_chat_template: str = option(
        "",
        "jinja chat template for requests with tools (default: the model's own when it "
        "renders tools, else a built-in Hermes ChatML template for ChatML models)",
    )
    allow_runtime_lora_updating: bool = option(
        False,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read folders on "
        "the workers' hosts; off: 403, as vLLM keeps them off unless asked)",
    )

    # Not a flag: --max-model-len as given (0: none), which caps every base model; set by
    # parse_config, which resolves max_model_len to the first model's.
    max_model_len_cap: int = 0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.default_max_tokens < 1:
            raise ValueError("max_body_bytes >= 1 and default_max_tokens >= 1")
        if self.default_booked_tokens < 0:
            raise ValueError("--default-booked-tokens >= 0")
        if self.max_inflight_tokens < 0 or not 0 < self.batch_admission_fraction <= 1:
            raise ValueError("--max-inflight-tokens >= 0 and 0 < --batch-admission-fraction <= 1")
        if self.refusal_memory < 0 or self.tokenizer_threads < 1:
            raise ValueError("--refusal-memory >= 0 seconds and --tokenizer-threads >= 1")
        if not (self.request_timeout > 0 and self.max_request_timeout > 0):
            raise ValueError("--request-timeout and --max-request-timeout must be > 0")
        check_ms(self.slo_ttft_ms, "--slo-ttft-ms")
        check_ms(self.slo_tpot_ms, "--slo-tpot-ms")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")

    @property
    def tls(self) -> TLSFiles | None:
        """The gateway's mutual-TLS identity towards the routers (None: plaintext)."""
        return self.mtls.files


def options(env: Mapping[str, str] | None = None) -> Options:
    """The gateway's command line."""
    return Options(GatewayConfig, "tandem gateway", "The OpenAI-compatible gateway.", env)


def parse_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> GatewayConfig:
    """The frozen config from flags, falling back to TANDEM_* variables of ``env``: the served
    name and context length resolved from the model folder, the keys file's entries added."""
    opts = options(env)
    try:
        config = opts.parse(argv)
        config.mtls.check()
        keys = config.api_keys + (
            load_keys_file(config.api_keys_file) if config.api_keys_file else ()
        )
    except (OSError, ValueError) as e:
        opts.error(str(e))
    if not config.routers:
        opts.error("no router: pass --router HOST:PORT or set TANDEM_ROUTER")
    model_dir = Path(config.model_dir)
    context = _context(config.model_dir)
    cap = config.max_model_len
    config = replace(
        config,
        served_model_name=config.served_model_name or model_dir.resolve().name,
        max_model_len=min(cap, context) if cap else context,
        max_model_len_cap=cap,
        api_keys=keys,
    )
    try:
        models = model_configs(config)
    except (OSError, ValueError) as e:
        opts.error(f"--extra-model: {e}")
    longest = max(_context(c.model_dir) for c in models)
    if cap and not 1 < cap <= longest:
        opts.error(f"--max-model-len must be in [2, {longest}] for the served models")
    return config


def _context(model_dir: str) -> int:
    return ModelConfig.from_dir(model_dir).max_position_embeddings


def model_configs(config: GatewayConfig) -> list[GatewayConfig]:
    """The config of each served base model: ``config`` itself, then one per
    ``--extra-model`` (its folder, name and context length: its own, capped by
    ``--max-model-len`` when given, as its workers cap it; every other setting shared)."""
    out = [config]
    for name, folder in parse_models(config.extra_models).items():
        if name in (c.served_model_name for c in out):
            raise ValueError(f"model {name!r} is named twice")
        context = _context(folder)
        length = min(config.max_model_len_cap, context) if config.max_model_len_cap else context
        out.append(
            replace(
                config, model_dir=folder, served_model_name=name, max_model_len=length,
                extra_models=(),
            )
        )  # fmt: skip
    return out
