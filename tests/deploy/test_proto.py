"""The .proto contracts: generated code is current, and every definition is documented."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"
PROTO_FILES = sorted((PROTO_DIR / "tandem" / "v1").glob("*.proto"))

# Lines that declare something a reader needs explained: services, rpcs, messages, enums,
# oneofs, fields (incl. map<> and oneof members) and enum values.
DECLARATION = re.compile(
    r"""^(
        (service|rpc|message|enum|oneof)\s+\w+
      | ((optional|repeated)\s+)?(map<[^>]+>|[\w.]+)\s+\w+\s*=\s*\d+   # field
      | \w+\s*=\s*-?\d+                                                 # enum value
    )""",
    re.VERBOSE,
)


def undocumented(text: str) -> list[str]:
    """Declarations whose previous non-blank line is not a `//` comment."""
    missing = []
    previous = ""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        declares = DECLARATION.match(line) and not line.startswith(("syntax", "package", "option"))
        if declares and not previous.startswith("//"):
            missing.append(f"{number}: {line}")
        previous = line
    return missing


def run_check(proto_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(proto_dir / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generated_code_is_current():
    result = run_check(PROTO_DIR)
    assert result.returncode == 0, result.stderr + result.stdout


def test_check_reports_stale_files(tmp_path: Path):
    copy = tmp_path / "proto"
    shutil.copytree(PROTO_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert run_check(copy).returncode == 0
    router = copy / "tandem" / "v1" / "router_pb2.py"
    router.write_text(router.read_text() + "# edited by hand\n")
    (copy / "tandem" / "v1" / "gone_pb2.py").write_text("")
    result = run_check(copy)
    assert result.returncode == 1
    assert "proto/tandem/v1/router_pb2.py" in result.stderr
    assert "proto/tandem/v1/gone_pb2.py" in result.stderr
    assert "common_pb2.py" not in result.stderr


def test_proto_files_exist():
    assert {p.name for p in PROTO_FILES} >= {"common.proto", "router.proto", "worker.proto"}


@pytest.mark.parametrize("proto", PROTO_FILES, ids=lambda p: p.name)
def test_every_definition_has_a_comment(proto: Path):
    assert undocumented(proto.read_text()) == []


def test_comment_check_catches_missing_comments():
    text = """
    // Documented.
    message A {
      // Documented.
      int32 x = 1;
      repeated string y = 2;
      map<string, int32> z = 3;
    }
    service S {
      rpc Go(A) returns (stream A);
    }
    enum E {
      // Documented.
      E_UNSPECIFIED = 0;
      E_ONE = 1;
    }
    message B {}
    """
    assert [m.split(": ", 1)[1] for m in undocumented(text)] == [
        "repeated string y = 2;",
        "map<string, int32> z = 3;",
        "service S {",
        "rpc Go(A) returns (stream A);",
        "enum E {",
        "E_ONE = 1;",
        "message B {}",
    ]
