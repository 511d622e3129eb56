"""The figure every benchmark's plot is drawn on (``figure``), in a module of its own.

Why not in ``report``: this needs only matplotlib, imported when a plot is drawn, while ``report`` imports the
harness (and with it torch); drivers that run beside a server and import nothing heavy (``fault_storm``,
``serving_before_after``) draw their plots through it too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def figure(path: Path, *rows_cols: int, dpi: int = 120, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure and its axes (``plt.subplots(*rows_cols, **subplots)``), laid out and written to ``path``
    as a PNG when the block ends without an error, and closed either way.

    One place for what every benchmark's plot does around its drawing: the headless Agg backend (benchmarks run
    on machines without a display) and the layout, resolution and release of the figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*rows_cols, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
