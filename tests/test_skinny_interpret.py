"""The skinny decode products (``kernels.triton_skinny``) run on the CPU through Triton's
interpreter, against the references: every path (one row and several on the CUDA cores, the
tensor-core path, split-K, uneven tiles, FP8 weights, both prologues) on small shapes.

Skipped unless Triton is importable; the repository does not depend on it on CPU hosts:

    pip install --target /tmp/triton-3.6 triton==3.6.0 "numpy<2.3"
    PYTHONPATH=/tmp/triton-3.6 .venv/bin/python -m pytest -q tests/test_skinny_interpret.py

(Triton 3.6's interpreter indexes 1-element arrays as scalars, which numpy 2.3 refused.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (see the docstring)"
)

SCRIPT = """
import json, torch
from tests.skinny_cases import prologue_cases, product_cases, small_plans
fma, dot = small_plans(dot_ok=False), [p for p in small_plans() if p.dot]
rows = product_cases("cpu", torch.bfloat16, fma, shapes=((40, 96),), rows=(1, 3))
# The interpreter's bf16 tl.dot is wrong (fp16 is right): the tensor-core path in fp16 here.
rows += product_cases("cpu", torch.float16, dot, shapes=((40, 96),), rows=(2,))
rows += prologue_cases("cpu", torch.bfloat16, fma[:3] + fma[-1:], rows=(1, 3), exact=False)
rows += prologue_cases("cpu", torch.float16, dot[:1], rows=(2,))
print(json.dumps(rows))
"""


def test_interpreter_matches_references():
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip("Triton 3.6's interpreter needs numpy < 2.3 (see the docstring)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) >= 46
    bad = [(n, e) for n, e in rows if not e < 1e-2]
    assert not bad, bad[:10]
