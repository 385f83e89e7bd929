"""A PNG of a simulation: load and replicas per interval (top), TTFT at the SLO percentile against the SLO
(bottom). matplotlib when installed, else a plain line plot drawn with Pillow."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulator's CLI imports this module to draw its result
    from splitserve.planner.simulator import SimResult

logger = logging.getLogger(__name__)

Series = tuple[str, Sequence[float | None], tuple[int, int, int]]


def _series(res: SimResult) -> tuple[list[float], list[Series], list[Series]]:
    xs = [i.time_s for i in res.intervals]
    top: list[Series] = [("arrivals req/s", [i.arrival_rate for i in res.intervals], (120, 120, 120)),
                         ("prefill replicas", [float(i.prefill) for i in res.intervals], (31, 119, 180)),
                         ("decode replicas", [float(i.decode) for i in res.intervals], (214, 39, 40))]
    pct = f"p{res.slo.percentile * 100:g}"
    bottom: list[Series] = [(f"TTFT {pct} s", [i.ttft_p for i in res.intervals], (44, 160, 44)),
                            (f"TTFT SLO {res.slo.ttft_s} s", [res.slo.ttft_s] * len(xs), (0, 0, 0))]
    return xs, top, bottom


def write_png(res: SimResult, path: str | Path, title: str = "") -> None:
    """Write the plot; matplotlib if importable, else Pillow."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _pillow_png(res, Path(path), title)
        return
    xs, top, bottom = _series(res)
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for ax, group in zip(axes, (top, bottom), strict=True):
        for label, ys, rgb in group:
            ax.plot(xs, [math.nan if y is None else y for y in ys], label=label, color=[c / 255 for c in rgb])
        ax.legend(loc="upper right")
    axes[0].set_title(title)
    axes[1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _pillow_png(res: SimResult, path: Path, title: str) -> None:
    from PIL import Image, ImageDraw

    xs, top, bottom = _series(res)
    width, height, margin = 1000, 640, 50
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((margin, 10), title, fill="black")
    panel_h = (height - 3 * margin) // 2
    x_max = max(xs) if xs else 1.0
    for k, group in enumerate((top, bottom)):
        y0 = margin + k * (panel_h + margin)
        values = [v for _, ys, _ in group for v in ys if v is not None and math.isfinite(v)]
        y_max = max(values) * 1.1 if values else 1.0
        draw.rectangle((margin, y0, width - margin, y0 + panel_h), outline="black")
        for tick in range(5):  # y grid and labels
            v = y_max * tick / 4
            y = y0 + panel_h - panel_h * tick / 4
            draw.line((margin, y, width - margin, y), fill=(225, 225, 225))
            draw.text((5, y - 6), f"{v:.3g}", fill="black")
        for tick in range(6):
            x = margin + (width - 2 * margin) * tick / 5
            draw.text((x - 10, y0 + panel_h + 4), f"{x_max * tick / 5:.0f}s", fill="black")

        def pt(x: float, y: float, y0: int = y0, y_max: float = y_max) -> tuple[float, float]:
            return (margin + (width - 2 * margin) * x / x_max, y0 + panel_h - panel_h * min(y, y_max) / y_max)

        for n, (label, ys, rgb) in enumerate(group):
            prev = None
            for x, y in zip(xs, ys, strict=True):
                cur = pt(x, y) if y is not None and math.isfinite(y) else None
                if prev is not None and cur is not None:
                    draw.line((*prev, *cur), fill=rgb, width=2)
                prev = cur
            draw.text((width - margin - 170, y0 + 6 + 14 * n), label, fill=rgb)
    img.save(path)
    logger.info("wrote %s", path)
