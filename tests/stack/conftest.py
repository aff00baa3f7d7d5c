"""Every test in this folder starts the real stack (etcd and the services as processes on
loopback), so each is marked ``stack``: `make test-stack` runs them (CI does, after `make
test`) and the default run stays within its time. The two quick files in ``SMOKE`` stay in the
default run as its whole-stack check: readiness and health of a started stack, and no process
left behind by a killed `tandem serve`."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
SMOKE = {"test_e2e_health.py", "test_no_orphans.py"}


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = Path(str(item.fspath))
        if path.parent == HERE and path.name not in SMOKE:
            item.add_marker(pytest.mark.stack)
