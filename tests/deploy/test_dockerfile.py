"""The Dockerfile the chart's image is built from (not built here: no Docker daemon in CI):
its entrypoint is the `tandem` command, every service the chart starts is a subcommand of it,
the build context keeps what `pip install` needs, and the exposed ports are the chart's."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
import yaml

from cli.main import SERVICES, main
from tests.helm_render import CHART, ROOT, find_helm, render, workloads


def instructions(name: str) -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    return [m.group(1) for m in re.finditer(rf"^{name}\s+(.+)$", text, re.MULTILINE)]


def test_entrypoint_is_the_tandem_command() -> None:
    (entrypoint,) = instructions("ENTRYPOINT")
    assert json.loads(entrypoint) == ["tandem"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tandem"] == "cli.main:main"


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_entrypoint_exists(service, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([service, "--help"])
    assert exit_info.value.code == 0
    assert "--model-dir" in capsys.readouterr().out  # the service's own parser answered


def test_chart_containers_run_tandem_subcommands() -> None:
    docs = render(find_helm(), "disagg-xpyd")
    started = {c["args"][0] for _, c in workloads(docs)}
    assert started == set(SERVICES)
    for _, container in workloads(docs):
        assert "command" not in container  # the image's ENTRYPOINT runs
        assert container["image"].startswith("ghcr.io/tandem-serving/tandem:")


def test_build_context_keeps_the_package() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = {p.rstrip("*").split(".")[0] for p in packages} | {"proto", "pyproject.toml"}
    needed.discard("tandem")  # generated API package, lives under proto/
    needed.add(config["project"]["readme"])
    assert needed & ignored == set()


def test_exposed_ports_are_the_charts() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    ports = {values[c]["port"] for c in ("gateway", "router", "prefill", "decode")}
    ports.add(values["metrics"]["port"])
    exposed = {int(p) for line in instructions("EXPOSE") for p in line.split()}
    assert exposed == ports


def test_image_installs_the_nixl_build_of_its_cuda() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["cu12"] == ["nixl-cu12==1.5.1"] and extras["cu13"] == ["nixl-cu13==1.5.1"]
    args = dict(a.split("=", 1) for a in instructions("ARG") if "=" in a)
    assert args["NIXL"] in extras and "cuda:12" in args["CUDA_IMAGE"]
    assert any('"/src[${NIXL}]"' in run for run in instructions("RUN"))


def test_the_image_takes_fa3_from_the_vllm_wheel_built_for_its_torch() -> None:
    """The FA3 extension is linked against one torch: the image's torch must be the one the
    vLLM release it takes FA3 from was built for (vLLM 0.26.0: torch 2.11), and the file it
    extracts is the one `kernels.flash_attn` imports and `bench.device.prepare` packs."""
    from bench.device.prepare import FA3_MEMBER, VLLM
    from kernels.flash_attn import MODULES

    args = dict(a.split("=", 1) for a in instructions("ARG") if "=" in a)
    assert args["FA3_FROM"] == VLLM == "vllm==0.26.0"
    assert args["TORCH_VERSION"].startswith("2.11.")
    text = (ROOT / "Dockerfile").read_text()
    assert FA3_MEMBER in text and f"/{MODULES[0]}.abi3.so" in text
