"""Fixtures of the GPU tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def tokenizer_dir(request) -> Path:
    """The tokenizer the device scripts carry (``TANDEM_TOKENIZER_DIR``), else the bundled
    model's folder: for tests whose model has random weights and needs only the tokenizer (the
    GPU host has no bundled model installed)."""
    carried = os.environ.get("TANDEM_TOKENIZER_DIR")
    return Path(carried) if carried else request.getfixturevalue("smol_dir")
