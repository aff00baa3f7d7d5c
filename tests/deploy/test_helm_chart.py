"""The Helm chart: `helm lint --strict` and `helm template` for every topology, the output
validated with kubernetes-validate (strict) for each Kubernetes version the chart claims, the
schema rejecting typos and wrong types, and what the pods get (GPUs, RDMA, probes, drain)."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from tests.helm_render import (
    CHART,
    CRD_KINDS,
    KUBE_VERSIONS,
    TOPOLOGIES,
    Manifest,
    by_kind,
    component,
    container_env,
    find_helm,
    render,
    run_helm,
    template_args,
    workloads,
)

VARIANTS = [None, *TOPOLOGIES]  # None: the chart's defaults


@pytest.fixture(scope="module")
def helm() -> str:
    return find_helm()


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str | None, list[Manifest]]:
    return {v: render(helm, v) for v in VARIANTS}


def test_topologies_exist() -> None:
    assert TOPOLOGIES == ["colocated", "disagg-1p1d", "disagg-xpyd"]


@pytest.mark.parametrize("topology", VARIANTS)
def test_lint_strict(helm, topology) -> None:
    args = ["lint", "--strict", str(CHART)]
    if topology:
        args += ["-f", str(CHART / "topologies" / f"{topology}.yaml")]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def check_crd_object(doc: Manifest) -> None:
    """CRD kinds have no schema in kubernetes-validate: check what KEDA and the Prometheus
    Operator need from them structurally."""
    assert doc["apiVersion"] == CRD_KINDS[doc["kind"]]
    spec = doc["spec"]
    if doc["kind"] == "ScaledObject":
        known = {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "cooldownPeriod",
                 "pollingInterval", "triggers", "advanced"}  # fmt: skip
        assert set(spec) <= known
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == spec["cooldownPeriod"]
        assert spec["scaleTargetRef"]["name"].endswith(("-prefill", "-decode"))
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert meta["serverAddress"].startswith("http") and meta["query"].startswith("sum(")
        assert float(meta["threshold"]) > 0 and isinstance(meta["threshold"], str)
    else:
        assert spec["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "tandem"
        assert [e["port"] for e in spec["endpoints"]] == ["metrics"]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("topology", VARIANTS)
def test_manifests_validate_strictly(rendered, topology, version) -> None:
    # The templates do not branch on the Kubernetes version: one rendering serves every
    # version (test_kube_version_constraint checks helm accepts each of them).
    docs = rendered[topology]
    kinds = set()
    for doc in docs:
        kinds.add(doc["kind"])
        if doc["kind"] in CRD_KINDS:
            check_crd_object(doc)
            continue
        kubernetes_validate.validate(doc, version, strict=True)
    assert {"Deployment", "Service", "ConfigMap", "StatefulSet", "PodDisruptionBudget"} <= kinds


def test_kube_version_constraint(helm) -> None:
    for version in (KUBE_VERSIONS[0], KUBE_VERSIONS[-1]):
        assert render(helm, kube_version=version)
    proc = run_helm(helm, *template_args(kube_version="1.28.0"))
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr


def test_validation_is_strict(rendered) -> None:
    """A misspelt field in a rendered Deployment is caught (the check above has teeth)."""
    (doc,) = [w for w, _ in workloads(rendered[None]) if component(w) == "router"]
    doc["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBE_VERSIONS[0], strict=True)


BAD_VALUES = {
    "router.replica=3": "Additional property replica is not allowed",
    "decode.gpus=two": "gpus",
    "decode.engine.dtype=fp8": "dtype",
    "prefill.kvTransport=rdma": "kvTransport",
    "decode.resources.request.cpu=1": "Additional property request is not allowed",
    "decode.tolerations[0].keyy=x": "Additional property keyy is not allowed",
    "decode.env.FOO=1": "FOO",
    "prefill.ucxEnv.TANDEM_X=1": "TANDEM_X",
    "model.source=s3": "source",
    "etcd.replicas=2": "replicas",
    "gateway.port=70000": "port",
    "metrics.serviceMonitor.interval=soon": "interval",
    "decode.autoscaling.mode=vpa": "mode",
    "typo=1": "Additional property typo is not allowed",
}


@pytest.mark.parametrize("setting", list(BAD_VALUES))
def test_schema_rejects_bad_values(helm, setting) -> None:
    for args in (template_args(sets=[setting]), ["lint", "--strict", str(CHART), "--set", setting]):
        proc = run_helm(helm, *args)
        assert proc.returncode != 0, f"{setting} was accepted by helm {args[0]}"
        assert BAD_VALUES[setting] in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "setting, message",
    [
        ("decode.terminationGracePeriodSeconds=60", "must exceed decode.drainTimeoutSeconds"),
        ("router.terminationGracePeriodSeconds=60", "must exceed router.preStopSleepSeconds"),
        ("etcd.enabled=false", "etcd.externalEndpoints is required"),
        ("model.source=image", "model.image.repository is required"),
        ("tls.enabled=true", "tls.enabled needs tls.secretName or tls.cert"),
    ],
)
def test_render_time_checks(helm, setting, message) -> None:
    proc = run_helm(helm, *template_args(sets=[setting]))
    assert proc.returncode != 0 and message in proc.stderr


def pod(docs: list[Manifest], role: str) -> Manifest:
    (doc,) = [w for w, _ in workloads(docs) if component(w) == role]
    return doc["spec"]["template"]["spec"]


def test_worker_pods_get_gpus_rdma_shm_and_drain_time(rendered) -> None:
    values = yaml.safe_load((CHART / "topologies" / "disagg-xpyd.yaml").read_text())
    for role in ("prefill", "decode"):
        spec = pod(rendered["disagg-xpyd"], role)
        (c,) = spec["containers"]
        rdma = values[role]["rdma"]["resourceName"]
        for kind in ("requests", "limits"):
            assert c["resources"][kind]["nvidia.com/gpu"] == 1
            assert c["resources"][kind][rdma] == 1
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        shm = [v for v in spec["volumes"] if v["name"] == "shm"][0]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert c["readinessProbe"]["grpc"]["service"] == ""
        assert c["livenessProbe"]["grpc"]["service"] == "liveness"
        assert spec["nodeSelector"] == values[role]["nodeSelector"]
        config = [d for d in by_kind(rendered["disagg-xpyd"], "ConfigMap")]
        (data,) = [d["data"] for d in config if component(d) == role]
        assert spec["terminationGracePeriodSeconds"] > float(data["TANDEM_DRAIN_TIMEOUT"])
    spec = pod(rendered[None], "decode")
    assert "capabilities" not in spec["containers"][0]["securityContext"]  # no RDMA: no IPC_LOCK


def test_tensor_parallel_pools_request_a_gpu_per_rank(helm) -> None:
    docs = render(
        helm, "disagg-1p1d", ["prefill.tensorParallelSize=4", "decode.tensorParallelSize=2"]
    )
    maps = by_kind(docs, "ConfigMap")
    for role, size in (("prefill", 4), ("decode", 2)):
        (c,) = pod(docs, role)["containers"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == size
        assert c["resources"]["limits"]["nvidia.com/gpu"] == size
        (data,) = [d["data"] for d in maps if component(d) == role]
        assert data["TANDEM_TENSOR_PARALLEL_SIZE"] == str(size)
    cpu = render(helm, None, ["decode.gpus=0", "decode.tensorParallelSize=2"])
    assert "nvidia.com/gpu" not in pod(cpu, "decode")["containers"][0]["resources"]["requests"]
    proc = run_helm(helm, *template_args(None, ["decode.tensorParallelSize=0"]))
    assert proc.returncode != 0 and "tensorParallelSize" in proc.stderr


def test_gateway_metrics_stay_off_the_api_service(rendered) -> None:
    services = {d["metadata"]["name"]: d for d in by_kind(rendered["disagg-xpyd"], "Service")}
    api = services["tandem-gateway"]
    assert [p["name"] for p in api["spec"]["ports"]] == ["http"]
    metrics = services["tandem-gateway-metrics"]
    assert metrics["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in metrics["spec"]["ports"]] == ["metrics"]


def test_tls_secret_from_pem_values(helm) -> None:
    sets = ["tls.enabled=true", "tls.cert=CERT", "tls.key=KEY", "tls.ca=CA"]
    docs = render(helm, sets=sets, kube_version=KUBE_VERSIONS[-1])
    (secret,) = [d for d in by_kind(docs, "Secret") if d["type"] == "kubernetes.io/tls"]
    assert secret["stringData"] == {"tls.crt": "CERT", "tls.key": "KEY", "ca.crt": "CA"}
    kubernetes_validate.validate(secret, KUBE_VERSIONS[-1], strict=True)
    for workload, _ in workloads(docs):
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        (tls,) = [v for v in volumes if v["name"] == "tls"]
        assert tls["secret"]["secretName"] == secret["metadata"]["name"]


def test_colocated_has_no_prefill_pool(rendered) -> None:
    names = {d["metadata"]["name"] for d in rendered["colocated"]}
    assert not any(n.endswith("-prefill") for n in names)
    assert pod(rendered["colocated"], "decode") and pod(rendered["colocated"], "router")


def test_router_has_two_replicas_and_pdbs_cover_every_component(rendered) -> None:
    for docs in rendered.values():
        (router,) = [w for w, _ in workloads(docs) if component(w) == "router"]
        assert router["kind"] == "StatefulSet" and router["spec"]["replicas"] == 2
        pdbs = {component(d) for d in by_kind(docs, "PodDisruptionBudget")}
        assert {component(w) for w, _ in workloads(docs)} | {"etcd"} == pdbs


@pytest.mark.parametrize("source", ["pvc", "hostPath", "image"])
def test_model_sources_render_and_validate(helm, source) -> None:
    sets = [f"model.source={source}", "model.image.repository=registry.example/llama-8b"]
    docs = render(helm, sets=sets, kube_version=KUBE_VERSIONS[-1])
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
    spec = pod(docs, "decode")
    (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
    expected = {"pvc": "persistentVolumeClaim", "hostPath": "hostPath", "image": "emptyDir"}
    assert expected[source] in volume
    assert [i["name"] for i in spec.get("initContainers", [])] == (
        ["copy-model"] if source == "image" else []
    )
    assert bool(by_kind(docs, "PersistentVolumeClaim")) == (source == "pvc")


def test_one_dashboard_configmap_per_json_file(helm) -> None:
    files = sorted((CHART / "dashboards").glob("*.json"))
    docs = render(helm, sets=["metrics.dashboards.enabled=true"])
    maps = [d for d in by_kind(docs, "ConfigMap") if component(d) == "dashboards"]
    assert len(maps) == len(files)
    keys = sorted(k for m in maps for k in m["data"])
    assert keys == [f.name for f in files]
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
    off = render(helm, sets=["metrics.dashboards.enabled=false"])
    assert not [d for d in by_kind(off, "ConfigMap") if component(d) == "dashboards"]


def test_extra_models_get_pools_of_their_own(helm) -> None:
    sets = [
        "extraModels[0].name=Qwen2.5-0.5B", "extraModels[0].servedModelName=qwen",
        "extraModels[0].decode.replicas=3", "extraModels[0].prefill.gpus=0",
    ]  # fmt: skip
    docs = render(helm, sets=sets, kube_version=KUBE_VERSIONS[-1])
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
    deployments = {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}
    extra = deployments["tandem-decode-qwen2-5-0-5b"]
    assert extra["spec"]["replicas"] == 3
    labels = extra["spec"]["selector"]["matchLabels"]
    assert labels != deployments["tandem-decode"]["spec"]["selector"]["matchLabels"]
    (container,) = extra["spec"]["template"]["spec"]["containers"]
    env = container_env(docs, container)
    assert env["TANDEM_MODEL_DIR"] == "/models/Qwen2.5-0.5B"
    assert env["TANDEM_SERVED_MODEL_NAME"] == "qwen"
    prefill = deployments["tandem-prefill-qwen2-5-0-5b"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in prefill["containers"][0]["resources"].get("limits", {})
    for name in ("gateway", "router"):
        (config,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith(name)]
        assert config["data"]["TANDEM_EXTRA_MODEL"] == "qwen=/models/Qwen2.5-0.5B"


def test_lora_values_reach_gateway_and_workers(helm) -> None:
    sets = ["lora.modules={sql=/models/adapters/sql,chat=/models/adapters/chat}",
            "lora.runtimeUpdating=true", "lora.maxLoras=8"]  # fmt: skip
    docs = render(helm, sets=sets)
    maps = {d["metadata"]["name"]: d["data"] for d in by_kind(docs, "ConfigMap")}
    for role in ("prefill", "decode"):
        data = maps[f"tandem-{role}"]
        assert data["TANDEM_LORA_MODULES"] == "sql=/models/adapters/sql,chat=/models/adapters/chat"
        assert data["TANDEM_ENABLE_LORA"] == "true" and data["TANDEM_MAX_LORAS"] == "8"
    assert maps["tandem-gateway"]["TANDEM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    off = {d["metadata"]["name"]: d["data"] for d in by_kind(render(helm), "ConfigMap")}
    assert "TANDEM_ALLOW_RUNTIME_LORA_UPDATING" not in off["tandem-gateway"]
    assert "TANDEM_LORA_MODULES" not in off["tandem-decode"]


def test_pools_can_follow_the_routers_planner(helm) -> None:
    """``autoscaling.signal: planner``: KEDA queries the routers' recommended worker count of
    the role (one replica per unit), an HPA reads it as an External metric; the router's
    config carries the SLO defaults the planner and the disagg choice use."""
    sets = ["prefill.autoscaling.enabled=true", "prefill.autoscaling.signal=planner",
            "decode.autoscaling.enabled=true", "decode.autoscaling.signal=planner",
            "decode.autoscaling.mode=hpa", "gateway.sloTpotMs=15"]  # fmt: skip
    docs = render(helm, sets=sets, kube_version=KUBE_VERSIONS[-1])
    (keda,) = by_kind(docs, "ScaledObject")
    check_crd_object(keda)
    meta = keda["spec"]["triggers"][0]["metadata"]
    assert (
        meta["query"].startswith("sum(tandem_planner_prefill_workers{") and meta["threshold"] == "1"
    )
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    kubernetes_validate.validate(hpa, KUBE_VERSIONS[-1], strict=True)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "tandem_planner_decode_workers"
    (config,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("router")]
    assert config["data"]["TANDEM_SLO_TPOT_MS"] == "15"
    assert config["data"]["TANDEM_SLO_SHED_FACTOR"] == "0"
