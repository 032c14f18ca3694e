"""matplotlib for the benchmarks that draw, as an optional extra.

A benchmark writes its JSON first and draws last; where matplotlib is missing it says once which extra
to install and carries on (exit 0), so the numbers of a long run are never lost to a plot.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

PLOTS_EXTRA = "pip install 'splitserve[bench]'"


@functools.cache
def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the file-only Agg backend, or None (said once, on stderr) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"plots skipped: matplotlib is not installed ({PLOTS_EXTRA} adds it)", file=sys.stderr, flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
