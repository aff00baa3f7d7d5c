"""Every flag and environment variable the chart gives a Tandem container is one the service
accepts: the rendered args and env go through each service's real config parser, which must
accept the args and read every TANDEM_* variable set (a misspelt variable is silently ignored
by a service, so "read" is checked by recording the lookups)."""

from __future__ import annotations

import importlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm_render import (
    CHART,
    FIELD_VALUES,
    SECRET_VALUE,
    SERVICES,
    TOPOLOGIES,
    Manifest,
    RecordingEnv,
    by_kind,
    component,
    container_env,
    find_helm,
    render,
    workloads,
)

# Environment a worker container may carry for the libraries under it (UCX, NIXL).
LIBRARY_ENV = re.compile(r"^(UCX|NIXL)_[A-Z0-9_]+$")
# Values that exercise optional parts of the chart (API-key Secret, tracing, extra env).
VARIANTS = {
    "defaults": (None, ()),
    **{t: (t, ()) for t in TOPOLOGIES},
    "api-keys-and-tracing": (
        None,
        (
            "apiKeys.keys={sk-1,sk-2:team}",
            "tracing.otlpEndpoint=otel-collector.monitoring:4317",
            "gateway.maxModelLen=8192",
            "decode.env.TANDEM_KV_TRANSFER_TIMEOUT=20",
            "metrics.enabled=false",
        ),
    ),
    "secured": (
        None,
        (
            "tls.enabled=true",
            "tls.secretName=tandem-mtls",
            "etcd.tls.secretName=etcd-tls",
            "etcd.auth.user=tandem",
            "etcd.auth.passwordSecret=etcd-password",
            f"apiKeys.entries[0].sha256={'ab' * 32}",
            "apiKeys.entries[0].tenant=acme",
            "apiKeys.entries[0].tokens_per_window=100000",
            "gateway.httpsSecretName=gateway-https",
            "router.policy=session",
        ),
    ),
    "existing-keys-secret": (None, ("apiKeys.existingSecret=my-keys", "apiKeys.secretKey=t.json")),
    # The worker options whose values are off (or null) by default.
    "engine-options": (
        None,
        tuple(
            f"{role}.{setting}"
            for role in ("prefill", "decode")
            for setting in (
                "engine.kvCacheBytes=8589934592",
                "engine.numKvBlocks=4096",
                "engine.maxModelLen=8192",
                "engine.quantization=fp8",
                "engine.quantizeLmHead=true",
                "engine.kvCacheDtype=fp8",
                'engine.speculativeConfig:="{\\"method\\": \\"ngram\\", '
                '\\"num_speculative_tokens\\": 4}"',
                "kvChecksums=false",
                "engine.kvHostCacheGib:=8",
                "engine.kvSwapMinTokens=128",
            )
        ),
    ),
}
# Values that set the rest of the options (the gateway reads an extra model's folder, so these
# are rendered only to see which options are set: test_helm_chart checks what they set).
MORE_SETTINGS = (
    "extraModels[0].name=Qwen2.5-0.5B",
    "lora.modules={sql=/models/adapters/sql}",
    "lora.runtimeUpdating=true",
    "prefill.engine.kvDiskCacheGib=50",
    "decode.engine.kvDiskCacheGib=50",
)
# Options a service declares that no value of the chart sets, and why; every other option must
# reach its service from some variant's values (`test_every_option_reaches_its_service`).
NOT_IN_CHART = {
    "gateway": {
        "--trace-file": "a local file of spans; in a cluster they go to tracing.otlpEndpoint",
        "--router-api-key": "services authenticate each other by mutual TLS (tls.enabled)",
        "--tool-chat-template": "a template file the pod would need mounted (gateway.env with "
        "an image that carries it)",
    },
    "router": {
        "--trace-file": "a local file of spans; in a cluster they go to tracing.otlpEndpoint",
        "--api-key": "services authenticate each other by mutual TLS (tls.enabled)",
        **{
            f: "run-time role switching is local; in a cluster the autoscaler sizes the pools "
            "from the same planner figures (autoscaling.signal: planner)"
            for f in (
                "--balance-roles",
                "--balance-interval",
                "--role-min-dwell",
                "--role-hysteresis",
            )
        },  # fmt: skip
    },
    **{
        role: {
            "--trace-file": "a local file of spans; in a cluster they go to tracing.otlpEndpoint",
            "--kv-fault": "test only: damages KV in transit",
            "--cuda-ipc": "a pod sees only its own GPUs, so CUDA IPC never pairs two pods",
            "--switchable": "a pod's role is its Deployment's; the autoscaler sizes each pool",
            **other_role,
        }
        for role, other_role in {
            "prefill": {
                f: "a decode worker's option"
                for f in (
                    "--nixl-mode",
                    "--on-transfer-failure",
                    "--kv-transfer-timeout",
                    "--stream-interval",
                )  # fmt: skip
            },
            "decode": {"--lease-seconds": "a prefill worker's option"},
        }.items()
    },
}
SECRET_DIR = "/etc/tandem/"
SAMPLE_KEYS_FILE = json.dumps({"keys": [{"sha256": "cd" * 32, "tenant": "ops"}]})
# The shape of Llama-3.1-8B (no weights): the gateway reads the context length from it.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    helm = find_helm()
    return {name: render(helm, topo, sets) for name, (topo, sets) in VARIANTS.items()}


def parse(service: str, argv: list[str], env: RecordingEnv, monkeypatch) -> Any:
    """Run the service's own config parser on ``argv`` with ``env`` as the whole environment."""
    module = importlib.import_module(f"services.{service}.__main__")
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the chart sets no deprecated variable
        m.setattr(os, "environ", env)
        try:
            return module.parse_config(argv, env)
        except SystemExit as e:
            pytest.fail(f"{service} rejected the chart's args {argv} / env {dict(env)}: exit {e}")


def secret_file(docs: list[Manifest], pod: Manifest, container: Manifest, path: str) -> str:
    """The content ``path`` will have in the container: it must be mounted from a Secret that
    has the file (chart-made Secrets give their content, others a stand-in)."""
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    name = path.removeprefix(mount["mountPath"] + "/")
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
    key = items.get(name, name)
    secrets = {d["metadata"]["name"]: d["stringData"] for d in by_kind(docs, "Secret")}
    made = secrets.get(volume["secret"]["secretName"])
    if made is not None:
        assert key in made, f"{path}: Secret {volume['secret']['secretName']} has no {key}"
        return made[key]
    return SAMPLE_KEYS_FILE if name.endswith(".json") else "-----BEGIN STAND-IN-----\n"


def files_stand_in(tmp_path: Path, docs, workload, container, env: dict[str, str]) -> None:
    """Point every TANDEM_* file path of ``env`` at a local copy of what the pod would mount."""
    pod = workload["spec"]["template"]["spec"]
    for name, value in env.items():
        if value.startswith(SECRET_DIR):
            local = tmp_path / component(workload) / value.removeprefix(SECRET_DIR)
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(secret_file(docs, pod, container, value))
            env[name] = str(local)


def model_stand_in(tmp_path: Path, docs: list[Manifest], env: dict[str, str]) -> str:
    """A folder with the served model's config.json in place of the chart's model volume."""
    folder = tmp_path / Path(env["TANDEM_MODEL_DIR"]).name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return str(folder)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_flag_and_env_var_is_accepted(variant, rendered, tmp_path, monkeypatch) -> None:
    docs = rendered[variant]
    seen = set()
    for workload, container in workloads(docs):
        role = component(workload)
        args = container["args"]
        assert args[0] == role and role in SERVICES, args
        env = container_env(docs, container)
        chart_model_dir = env["TANDEM_MODEL_DIR"]
        if role == "gateway":
            env["TANDEM_MODEL_DIR"] = model_stand_in(tmp_path, docs, env)
        files_stand_in(tmp_path, docs, workload, container, env)
        recorded = RecordingEnv(env)
        config = parse(role, args[1:], recorded, monkeypatch)
        tandem_vars = {k for k in env if k.startswith("TANDEM_")}
        assert tandem_vars - recorded.read == set(), f"{role} never reads these"
        others = set(env) - tandem_vars
        if role in ("prefill", "decode"):
            assert all(LIBRARY_ENV.match(k) for k in others), others
        else:
            assert others == set(), others
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert config.host == "0.0.0.0"
        assert config.port == ports["http" if role == "gateway" else "grpc"]
        if role == "gateway":  # every router replica, by its stable name
            replicas = [w for w, _ in workloads(docs) if component(w) == "router"]
            count = replicas[0]["spec"]["replicas"]
            expected = [f"tandem-router-{i}.tandem-router-headless.llm.svc:" for i in range(count)]
            assert [r.rsplit(":", 1)[0] + ":" for r in config.routers] == expected
        else:
            assert config.model_dir == chart_model_dir
            assert config.advertise_host == FIELD_VALUES["status.podIP"]
            assert ",".join(config.etcd) == env["TANDEM_ETCD"]
        seen.add(role)
    expected = {"gateway", "router", "decode"} | ({"prefill"} if variant != "colocated" else set())
    assert seen == expected


def test_parsed_values_follow_the_chart_values(rendered, monkeypatch) -> None:
    """Values reach the config they are meant for (not just any accepted variable)."""
    values = yaml.safe_load((CHART / "topologies" / "disagg-xpyd.yaml").read_text())
    docs = rendered["disagg-xpyd"]
    for workload, container in workloads(docs):
        role = component(workload)
        if role not in ("prefill", "decode"):
            continue
        env = RecordingEnv(container_env(docs, container))
        config = parse(role, container["args"][1:], env, monkeypatch)
        assert config.worker_id == FIELD_VALUES["metadata.name"]
        assert config.kv_transport == "nixl"
        assert env["UCX_TLS"] == values[role]["ucxEnv"]["UCX_TLS"]
        if role == "decode":
            assert config.nixl_mode == values["decode"]["nixlMode"]


def test_api_keys_come_from_the_secret(rendered, monkeypatch, tmp_path) -> None:
    docs = rendered["api-keys-and-tracing"]
    (secret,) = by_kind(docs, "Secret")
    keys = secret["stringData"]["api-keys"]
    assert keys == "sk-1,sk-2:team"
    (gateway,) = [c for w, c in workloads(docs) if component(w) == "gateway"]
    (ref,) = [e for e in gateway["env"] if e["name"] == "TANDEM_API_KEY"]
    expected_ref = {"name": secret["metadata"]["name"], "key": "api-keys"}
    assert ref["valueFrom"]["secretKeyRef"] == expected_ref
    env = container_env(docs, gateway)
    env["TANDEM_API_KEY"] = keys
    env["TANDEM_MODEL_DIR"] = model_stand_in(tmp_path, docs, env)
    config = parse("gateway", gateway["args"][1:], RecordingEnv(env), monkeypatch)
    assert len(config.api_keys) == 2 and "team" in {k.tenant for k in config.api_keys}
    assert config.max_model_len == 8192


def test_security_settings_reach_every_service(rendered, tmp_path, monkeypatch) -> None:
    docs = rendered["secured"]
    for workload, container in workloads(docs):
        role = component(workload)
        env = container_env(docs, container)
        if role == "gateway":
            env["TANDEM_MODEL_DIR"] = model_stand_in(tmp_path, docs, env)
        files_stand_in(tmp_path, docs, workload, container, env)
        config = parse(role, container["args"][1:], RecordingEnv(env), monkeypatch)
        tls = config.tls if role == "gateway" else config.security.tls
        assert tls is not None and tls.server_name == "tandem.internal"
        probes = [container[p] for p in ("readinessProbe", "livenessProbe")]
        if role == "gateway":
            assert config.ssl_certfile.endswith("tls.crt") and config.ssl_keyfile
            (key,) = config.api_keys
            assert key.sha256 == "ab" * 32 and key.tenant == "acme"
            assert probes[0]["httpGet"]["scheme"] == "HTTPS"
        else:
            etcd = config.security.etcd
            assert etcd.ca and etcd.cert and etcd.key and etcd.user == "tandem"
            assert etcd.password == SECRET_VALUE
            assert all("tcpSocket" in p for p in probes)  # kubelet gRPC probes speak no TLS
        if role == "router":
            assert config.policy == "session"


def test_every_option_reaches_its_service(rendered) -> None:
    """Every flag a service declares is set by the chart (as an argument or its TANDEM_*
    variable, from some variant's values) or named in NOT_IN_CHART with the reason; a flag
    added to a service without a value fails here until it gets one or a reason."""
    from tests.services.test_options import SERVICES as OPTIONS

    given: dict[str, set[str]] = {role: set() for role in OPTIONS}
    for docs in [*rendered.values(), render(find_helm(), None, MORE_SETTINGS)]:
        for workload, container in workloads(docs):
            role = component(workload)
            given[role] |= set(container_env(docs, container))
            given[role] |= {a for a in container["args"] if a.startswith("--")}
    for role, options in OPTIONS.items():
        declared = {s.flag: s for s in options({}).specs}
        left_out = NOT_IN_CHART[role]
        assert set(left_out) <= set(declared), f"{role}: no such flags"
        missing = [
            f for f, s in declared.items() if f not in left_out and not {f, s.env} & given[role]
        ]
        assert missing == [], f"{role}: no chart value sets {missing}"
        both = [f for f, s in declared.items() if f in left_out and {f, s.env} & given[role]]
        assert both == [], f"{role}: set by the chart yet listed as left out: {both}"


def test_admission_engine_and_kv_values_reach_their_configs(rendered, tmp_path, monkeypatch):
    """The values added for the router's, gateway's and workers' newer options land in the
    config field each is for, with the chart's defaults and with every engine option set."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for variant in ("defaults", "engine-options"):
        docs = rendered[variant]
        for workload, container in workloads(docs):
            role = component(workload)
            env = container_env(docs, container)
            if role == "gateway":
                env["TANDEM_MODEL_DIR"] = model_stand_in(tmp_path, docs, env)
            config = parse(role, container["args"][1:], RecordingEnv(env), monkeypatch)
            if role == "gateway":
                v = values["gateway"]
                assert config.refusal_memory == v["refusalMemory"]
                assert config.tokenizer_threads == v["tokenizerThreads"]
                assert config.tool_call_parser == v["toolCallParser"]
                assert config.token_path == v["tokenPath"]
            elif role == "router":
                v = values["router"]
                assert config.refusal_memory == v["refusalMemory"]
                assert config.max_migrations == v["maxMigrations"]
                assert config.kv_recent_ttl == v["kvRecentTtl"]
            else:
                location = values[role]["kvLocation"]
                assert (config.kv_location_blocks, config.kv_location_interval,
                        config.kv_location_budget) == tuple(location.values())  # fmt: skip
                changed = variant == "engine-options"
                assert config.kv_checksums is not changed
                assert config.num_kv_blocks == (4096 if changed else None)
                assert config.max_model_len == (8192 if changed else None)
                assert config.quantization == ("fp8" if changed else None)
                assert config.quantize_lm_head is changed
                assert config.kv_cache_dtype == ("fp8" if changed else "auto")
                assert config.kv_host_cache_gib == (8.0 if changed else None)
                assert config.kv_swap_min_tokens == (128 if changed else 64)
                spec = config.speculative_config
                assert (spec and spec.num_speculative_tokens) == (4 if changed else None)
