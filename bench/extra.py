"""What ``tandem bench`` needs beyond the serving stack: the ``bench`` extra of the package
(aiohttp, which streams the requests, tqdm's progress bars, matplotlib for the plots).

The serving stack installs without them (``pip install tandem``); ``make install`` installs
the extra. Every import of them in ``bench`` is inside the function that uses it, so the
package imports without them, and `require` says which to install before a run starts.
"""

from __future__ import annotations

import importlib

EXTRA = "bench"
RUN = ("aiohttp", "tqdm")  # every run
PLOTS = ("matplotlib",)  # unless --no-plots


def missing(plots: bool = True) -> list[str]:
    """The extra's modules that do not import here (only those a run with ``plots`` needs)."""
    gone = []
    for name in RUN + (PLOTS if plots else ()):
        try:
            importlib.import_module(name)
        except ImportError:
            gone.append(name)
    return gone


def require(plots: bool = True) -> None:
    """Exit with what to install when a module of the extra is missing."""
    gone = missing(plots)
    if gone:
        raise SystemExit(
            f"tandem bench needs {', '.join(gone)}, from the '{EXTRA}' extra: "
            f"pip install 'tandem[{EXTRA}]' (make install installs it)"
        )
