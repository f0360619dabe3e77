"""Chart data from matplotlib figures: the ``e2b/chart`` display format the SDKs parse.

Runs inside a python kernel (imported there by a hidden cell the server runs when the
context starts): ``install()`` adds an ``e2b/chart`` formatter to IPython's display
formatter that answers for ``matplotlib.figure.Figure`` (matched by name, so nothing imports
matplotlib until a figure is shown).
When the inline backend shows a figure, its display bundle then carries ``e2b/chart`` beside
``image/png``, and the server turns that into the ``chart`` key of a result line.

The shape is the one e2b-code-interpreter's ``charts.py`` reads: ``type`` (line, scatter,
bar, pie, box_and_whisker, superchart, unknown), ``title``, ``elements`` and, for charts
with axes, labels, units, ticks, tick labels and scales. One axes gives one chart; several
give a ``superchart`` whose elements are the axes' charts. Box plots are not recognised
(they come out as line charts of their whiskers); what is not understood is left out rather
than guessed.
"""

from __future__ import annotations

import math
import re
from typing import Any

MIME = "e2b/chart"
_UNIT = re.compile(r"^(.*?)\s*[\(\[]([^\)\]]+)[\)\]]\s*$")


def install() -> bool:
    """Register the formatter in the running IPython kernel; False outside one."""
    try:
        from IPython import get_ipython
        from IPython.core.formatters import BaseFormatter
    except ImportError:
        return False
    ip = get_ipython()
    if ip is None:
        return False
    formatters = ip.display_formatter.formatters

    class ChartFormatter(BaseFormatter):
        """Matches figures by class name in ``__call__``, not through ``for_type``:
        IPython pops every formatter's Figure printer when a matplotlib backend is
        selected (pylabtools.select_figure_formats), which would drop ours."""

        format_type = MIME
        _return_type = (dict,)

        def __call__(self, obj: Any) -> dict[str, Any] | None:
            cls = type(obj)
            if not self.enabled or cls.__name__ != "Figure" \
                    or cls.__module__ != "matplotlib.figure":
                return None
            try:
                return figure_chart(obj)
            except Exception:  # a chart is a bonus: never fail the display for it
                return None

    formatters[MIME] = ChartFormatter(parent=ip.display_formatter)
    return True


def _num(value: Any) -> Any:
    """A JSON-safe number (or the value's string form)."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(f) or math.isinf(f):
        return None
    return int(f) if f.is_integer() and abs(f) < 2**53 else f


def _label_unit(text: str) -> tuple[str | None, str | None]:
    if not text:
        return None, None
    m = _UNIT.match(text)
    return (m.group(1), m.group(2)) if m else (text, None)


def _axes_fields(ax: Any) -> dict[str, Any]:
    x_label, x_unit = _label_unit(ax.get_xlabel())
    y_label, y_unit = _label_unit(ax.get_ylabel())
    return {
        "title": ax.get_title() or None,
        "x_label": x_label, "x_unit": x_unit, "y_label": y_label, "y_unit": y_unit,
    }


def _ticks(ax: Any) -> dict[str, Any]:
    return {
        "x_ticks": [_num(t) for t in ax.get_xticks()],
        "x_tick_labels": [t.get_text() for t in ax.get_xticklabels()],
        "x_scale": ax.get_xscale(),
        "y_ticks": [_num(t) for t in ax.get_yticks()],
        "y_tick_labels": [t.get_text() for t in ax.get_yticklabels()],
        "y_scale": ax.get_yscale(),
    }


def _visible_label(artist: Any, i: int) -> str:
    label = artist.get_label() or ""
    return label if label and not label.startswith("_") else f"series {i}"


def axes_chart(ax: Any) -> dict[str, Any] | None:
    """One axes' chart, or None when it holds nothing this module reads."""
    from matplotlib.collections import PathCollection
    from matplotlib.patches import Rectangle, Wedge

    wedges: list[Any] = [p for p in ax.patches if isinstance(p, Wedge)]
    if wedges:
        labels = [t.get_text() for t in ax.texts]
        return {"type": "pie", "title": ax.get_title() or None, "elements": [
            {"label": labels[i] if i < len(labels) else _visible_label(w, i),
             "angle": _num(w.theta2 - w.theta1), "radius": _num(w.r)}
            for i, w in enumerate(wedges)]}
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    if bars and ax.containers:
        elements = []
        ticks = {round(float(t), 6): lbl.get_text()
                 for t, lbl in zip(ax.get_xticks(), ax.get_xticklabels(), strict=False)}
        for i, container in enumerate(ax.containers):
            group = _visible_label(container, i)
            for bar in container:
                x = round(float(bar.get_x() + bar.get_width() / 2), 6)
                elements.append({"label": ticks.get(x) or str(_num(x)), "group": group,
                                 "value": _num(bar.get_height())})
        return {"type": "bar", **_axes_fields(ax), "elements": elements}
    scatters: list[Any] = [c for c in ax.collections if isinstance(c, PathCollection)]
    if scatters and not ax.lines:
        return {"type": "scatter", **_axes_fields(ax), **_ticks(ax), "elements": [
            {"label": _visible_label(c, i),
             "points": [[_num(x), _num(y)] for x, y in c.get_offsets()]}
            for i, c in enumerate(scatters)]}
    if ax.lines:
        return {"type": "line", **_axes_fields(ax), **_ticks(ax), "elements": [
            {"label": _visible_label(line, i),
             "points": [[_num(x), _num(y)] for x, y in line.get_xydata()]}
            for i, line in enumerate(ax.lines)]}
    return None


def figure_chart(fig: Any) -> dict[str, Any] | None:
    """The figure's chart: its one axes' chart, a superchart of several, or None."""
    charts = [c for c in (axes_chart(ax) for ax in fig.axes) if c is not None]
    if not charts:
        return None
    if len(charts) == 1:
        return charts[0]
    title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else None
    return {"type": "superchart", "title": title, "elements": charts}
