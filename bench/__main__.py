"""``python -m bench``: the serving load generator (same as ``tandem bench``)."""

import sys

from bench.cli import main

sys.exit(main())
