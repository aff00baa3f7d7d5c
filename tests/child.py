"""A Python snippet run as a process of its own: a peer that a test can kill -9."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@asynccontextmanager
async def python_child(code: str, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """Run ``python -c code args...`` from the repository (stdout piped); killed on exit."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *args, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
