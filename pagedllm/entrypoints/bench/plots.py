"""The `bench serve --plot` figure: TTFT histogram, ITL histogram, output tokens/s over time.

Drawn on a bare matplotlib `Figure` with the Agg canvas, never through pyplot, so it works
headless and leaves matplotlib's global backend alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

_BINS = 30


def _histogram(axes: Any, values_ms: Sequence[float], title: str) -> None:
    if values_ms:
        axes.hist(values_ms, bins=_BINS, color="tab:blue", edgecolor="white")
    else:
        # Every request failed (or produced one token): say so rather than draw nothing.
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
    axes.set_title(title)
    axes.set_xlabel("ms")
    axes.set_ylabel("count")


def plot_serve_run(path: str, report: dict[str, Any]) -> None:
    """Writes the three-panel figure of a `run_serve_benchmark` report to `path` (PNG)."""
    ttfts_ms = [1000 * t for t in report["ttfts"] if t is not None]
    itls_ms = [1000 * gap for gaps in report["itls"] for gap in gaps]
    series = report["output_throughput_series"]
    figure = Figure(figsize=(15, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    ttft_axes, itl_axes, rate_axes = figure.subplots(1, 3)
    _histogram(ttft_axes, ttfts_ms, "Time to first token")
    _histogram(itl_axes, itls_ms, "Inter-token latency")
    # One bar per 1-second bucket, from its start; the last one as long as the run lasted.
    widths = [1.0] * len(series)
    widths[-1] = min(1.0, max(0.05, report["duration"] - (len(series) - 1)))
    rate_axes.bar(range(len(series)), series, width=widths, align="edge", color="tab:green")
    rate_axes.set_title("Output tokens/s")
    rate_axes.set_xlabel("s since start")
    rate_axes.set_ylabel("tokens/s")
    rate_axes.set_ylim(bottom=0)
    figure.suptitle(f"bench serve: {report['model']}, {report['completed']} requests")
    figure.savefig(path, format="png", dpi=100)
