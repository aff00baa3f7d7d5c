"""Pack, into ``.device/`` (git-ignored, at most ~56 MiB so a device call carries it with the
repository), what a bare GPU host with PyTorch lacks to run the serving stack, its GPU tests
and its benchmarks:

- wheels (CPython 3.12, manylinux x86_64) of the stack's Python dependencies at the versions
  installed here, minus what the host already has (``HOST_HAS``);
- ``nixl-cu13`` cut down to NIXL's core, its UCX plugin and UCX (the full wheel is 56 MiB,
  mostly NIXL's expert-parallel kernels and storage plugins the stack never loads);
- the ``etcd`` server binary (xz-compressed; it needs only libc);
- the bundled model's tokenizer, for ``python -m engine.shapes`` on the host;
- with ``--fa3``, FlashAttention 3's extension (``_vllm_fa3_C``, xz-compressed, ~11 MiB) taken
  out of vLLM's wheel (`kernels.flash_attn`): the GPU host has no FA3 otherwise.

NIXL's wheel goes in its own folder (``.device/nixl``, ~15 MiB): a call that needs no NIXL
(one GPU: the hand-off is CUDA IPC) carries ``.device/wheels``, ``.device/etcd.xz``,
``.device/tokenizer`` and ``.device/fa3`` and stays under the 64 MiB a call carries.

    python -m bench.device.prepare [--fa3]  # then: device run with carry [".device"]
                                            #   bash bench/device/run.sh JOB

Idempotent: wheels already in ``.device/wheels`` are kept.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from engine.bundled import DEFAULT_DIR
from engine.shapes import TOKENIZER_FILES

# The stack's imports that the GPU host's image does not provide (its list: the device tool's
# KINDS.md). Versions are the ones installed here, so both hosts run the same code.
NEEDED = (
    "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "aetcd",
    "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types",
    "annotated-doc", "typing-inspection", "typing-extensions", "openai", "httpx2",
    "httpcore2", "truststore", "jiter", "sniffio", "opentelemetry-api", "opentelemetry-sdk",
    "opentelemetry-semantic-conventions", "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-otlp-common", "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-proto", "googleapis-common-protos", "pytest", "pytest-asyncio",
    "pytest-timeout", "pluggy", "iniconfig", "llguidance", "jsonschema",
    "jsonschema-specifications", "referencing", "rpds-py", "httptools",
)  # fmt: skip
NIXL = "nixl-cu13==1.5.1"
# FlashAttention 3 as vLLM builds it, for the GPU host's torch (2.11): vLLM 0.26.0's wheel.
VLLM = "vllm==0.26.0"
FA3_MEMBER = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64")  # fmt: skip
# Kept of the NIXL wheel: the Python API and bindings, the core library and its needs, the UCX
# plugin, UCX with its modules; everything else (nixl_ep, storage/cloud plugins) goes.
NIXL_DROP = (
    "nixl_ep_cu13/", "nixl_cu13.scripts/", "/libplugin_", "libucx_perftest",
    "libaws", "libazure", "libs2n", "libgusli", "libcurl", "libxml2", "libaio",
)  # fmt: skip
NIXL_KEEP = ("/libplugin_UCX.so",)


def download(requirements: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + requirements, check=True)


def slim_nixl(wheel: Path, out_dir: Path) -> Path:
    """``wheel`` without what the stack never loads (a valid wheel: RECORD rewritten)."""
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, 9) as dst:
        kept = []
        for item in src.infolist():
            name = item.filename
            if any(d in name for d in NIXL_DROP) and not any(k in name for k in NIXL_KEEP):
                continue
            if name.endswith(".dist-info/RECORD"):
                record = name
                continue
            dst.writestr(item, src.read(name))
            kept.append(name)
        dst.writestr(record, "".join(f"{n},,\n" for n in [*kept, record]))
    return out


def pack_fa3(out: Path, vllm_wheel: Path | None) -> None:
    """``out/_vllm_fa3_C.abi3.so.xz`` from ``vllm_wheel`` (downloaded when None)."""
    target = out / (Path(FA3_MEMBER).name + ".xz")
    if target.is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if vllm_wheel is None:
            download([VLLM], Path(tmp))
            vllm_wheel = next(Path(tmp).glob("vllm-*.whl"))
        with zipfile.ZipFile(vllm_wheel) as z:
            data = z.read(FA3_MEMBER)
        target.write_bytes(lzma.compress(data, preset=6))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device.prepare", description=__doc__)
    p.add_argument("--out", type=Path, default=Path(".device"))
    p.add_argument("--fa3", action="store_true", help="also pack FlashAttention 3 (see above)")
    p.add_argument("--vllm-wheel", type=Path, help="vLLM's wheel to take FA3 from (else pip)")
    args = p.parse_args(argv)
    wheels, nixl = args.out / "wheels", args.out / "nixl"
    wheels.mkdir(parents=True, exist_ok=True)
    nixl.mkdir(exist_ok=True)
    have = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels.glob("*.whl")}
    pins = [f"{n}=={metadata.version(n)}" for n in NEEDED if n not in have]
    if pins:
        download(pins, wheels)
    for old in wheels.glob("nixl_cu13-*.whl"):  # packed by an earlier version: its own folder
        old.rename(nixl / old.name)
    if not list(nixl.glob("nixl_cu13-*.whl")):
        with tempfile.TemporaryDirectory() as tmp:
            download([NIXL], Path(tmp))
            slim_nixl(next(Path(tmp).glob("nixl_cu13-*.whl")), nixl)
    if args.fa3:
        pack_fa3(args.out / "fa3", args.vllm_wheel)
    etcd = shutil.which("etcd")
    if etcd is None:
        raise SystemExit("etcd is not installed here (make install puts it in)")
    if not (args.out / "etcd.xz").is_file():
        (args.out / "etcd.xz").write_bytes(lzma.compress(Path(etcd).read_bytes(), preset=9))
    tok = args.out / "tokenizer"
    tok.mkdir(exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(DEFAULT_DIR / f, tok / f)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    count = len(list(args.out.glob("*/*.whl")))
    print(f"{args.out}: {count} wheels, {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
