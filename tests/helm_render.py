"""Render the Helm chart (helm/tandem) with the real helm v3 binary and read what it renders.

`make helm` fetches helm into ~/.cache/tandem/bin and `make test` passes its path in
``TANDEM_HELM``; there a missing binary fails the tests. Run directly, the tests skip when no
helm is found (``TANDEM_HELM``, the cache path, then ``PATH``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "tandem"
TOPOLOGIES = sorted(p.stem for p in (CHART / "topologies").glob("*.yaml"))
# The Kubernetes versions the chart claims (Chart.yaml kubeVersion, README); kubernetes-validate
# ships their OpenAPI schemas, so validation runs offline.
KUBE_VERSIONS = ("1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0")
# Kinds from CRDs (KEDA, Prometheus Operator): kubernetes-validate has no schema for them.
CRD_KINDS = {"ScaledObject": "keda.sh/v1alpha1", "ServiceMonitor": "monitoring.coreos.com/v1"}
SERVICES = ("gateway", "router", "prefill", "decode")

Manifest = dict[str, Any]


def find_helm() -> str:
    """The helm binary, or skip (fail under `make test`, which sets TANDEM_HELM)."""
    configured = os.environ.get("TANDEM_HELM")
    if configured:
        if not os.access(configured, os.X_OK):
            pytest.fail(f"TANDEM_HELM={configured} is not an executable helm (run `make helm`)")
        return configured
    cached = Path.home() / ".cache" / "tandem" / "bin" / "helm"
    found = str(cached) if os.access(cached, os.X_OK) else shutil.which("helm")
    if not found:
        pytest.skip("no helm binary: `make helm` fetches one")
    return found


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, check=False)


def template_args(
    topology: str | None = None, sets: Sequence[str] = (), kube_version: str | None = None
) -> list[str]:
    """Arguments of `helm template` for a topology (None: the chart's defaults); each of
    ``sets`` is ``key=value`` (``--set``) or ``key:=JSON`` (``--set-json``: a value with commas
    or braces, such as a JSON document given as a string)."""
    args = ["template", "tandem", str(CHART), "--namespace", "llm"]
    if topology:
        args += ["-f", str(CHART / "topologies" / f"{topology}.yaml")]
    for s in sets:
        key, json_sep, value = s.partition(":=")
        args += ["--set-json", f"{key}={value}"] if json_sep else ["--set", s]
    if kube_version:
        args += ["--kube-version", kube_version]
    return args


def render(
    helm: str,
    topology: str | None = None,
    sets: Sequence[str] = (),
    kube_version: str | None = None,
) -> list[Manifest]:
    """The rendered manifests (fails the test with helm's error when rendering fails)."""
    proc = run_helm(helm, *template_args(topology, sets, kube_version))
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def component(doc: Manifest) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def workloads(docs: list[Manifest]) -> Iterator[tuple[Manifest, Manifest]]:
    """(workload, container) for every container of the Tandem services (Deployments, and the
    routers' StatefulSet; not etcd)."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet") and component(doc) in SERVICES:
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


# Stand-ins for what the kubelet fills in at run time.
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "pod-abc"}
SECRET_VALUE = "sk-test-key:team-a"


def container_env(docs: list[Manifest], container: Manifest) -> dict[str, str]:
    """The environment the container would see: its ConfigMaps (envFrom) then its env list,
    with secrets and downward-API fields replaced by stand-ins."""
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in by_kind(docs, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in config_maps, f"envFrom names a ConfigMap the chart does not render: {name}"
        env.update(config_maps[name])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "fieldRef" in item["valueFrom"]:
            env[item["name"]] = FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            assert "secretKeyRef" in item["valueFrom"], item
            env[item["name"]] = SECRET_VALUE
    return env


class RecordingEnv(dict[str, str]):
    """An environment that remembers which variables were looked up."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)
