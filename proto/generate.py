"""Generate the Python, gRPC and type-stub code for `proto/tandem/v1/*.proto`.

Usage (from anywhere):

    python proto/generate.py          # (re)write proto/tandem/v1/*_pb2*.py{,i}
    python proto/generate.py --check  # exit 1, listing stale files, if the output is not current

Output lands beside the .proto files, so the modules import each other as
`tandem.v1.common_pb2`; pyproject maps the `tandem` package to `proto/tandem`. The generated
files are committed and never edited by hand: change the .proto and run this script.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "tandem" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """Every .proto file of the API, sorted so runs are reproducible."""
    return sorted(PACKAGE_DIR.glob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """Generated files under `root`, relative to it (mirrors the proto package layout)."""
    files = [p for p in (root / "tandem" / "v1").glob("*") if p.name.endswith(GENERATED_SUFFIXES)]
    return sorted(p.relative_to(root) for p in files)


def run_protoc(out_dir: Path) -> None:
    """Run grpc_tools.protoc over every .proto file, writing python, grpc and pyi into out_dir."""
    from grpc_tools import protoc  # imported here: only needed at generation time

    include = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    # protoc resolves the relative .proto paths against -I, independent of the cwd.
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def _fresh_output(tmp: Path) -> Path:
    """Run protoc into a scratch tree under `tmp` and return its root."""
    root = tmp / "out"
    (root / "tandem" / "v1").mkdir(parents=True)
    run_protoc(root)
    return root


def stale_files() -> list[str]:
    """Generated files that are missing, differ from a fresh run, or should not exist."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = _fresh_output(Path(tmp))
        fresh = set(generated_files(fresh_root))
        committed = set(generated_files(PROTO_ROOT))
        stale = [str(p) for p in fresh ^ committed]
        for rel in fresh & committed:
            if not filecmp.cmp(fresh_root / rel, PROTO_ROOT / rel, shallow=False):
                stale.append(str(rel))
    return sorted(stale)


def generate() -> list[Path]:
    """Regenerate in place (via a scratch dir, so a protoc error leaves the tree untouched)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = _fresh_output(Path(tmp))
        fresh = generated_files(fresh_root)
        for rel in set(generated_files(PROTO_ROOT)) - set(fresh):
            (PROTO_ROOT / rel).unlink()  # its .proto is gone
        for rel in fresh:
            shutil.copyfile(fresh_root / rel, PROTO_ROOT / rel)
    return fresh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="fail if the committed output is stale"
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated files (run `python proto/generate.py`):", file=sys.stderr)
            for name in stale:
                print(f"  proto/{name}", file=sys.stderr)
            return 1
        print("generated code is up to date")
        return 0
    for rel in generate():
        print(f"wrote proto/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
