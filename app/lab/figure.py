"""A lab result's figure: its series overlaid in one Plotly figure, drawn from the stored result alone."""
from __future__ import annotations

import os
from pathlib import Path

import plotly.graph_objects as go

from ..i18n import DEFAULT
from ..ui.charts import FONT_FAMILY, GRID_COLOR, LOG_TICKS
from .result import LabResult

# one colour per setting, in the order the experiment lists them (the first is the baseline)
PALETTE = ["#7d8796", "#2f6fdf", "#e8871e", "#2a9d61", "#b24bd1", "#d64545", "#16a3b8", "#8a6d3b"]


def figure(result: LabResult, lang: str = DEFAULT) -> go.Figure:
    """The run's figure, its words in lang."""
    result = result.in_language(lang)
    # Plotly draws an overlaying axis's traces above the others: bars counted on the right-hand axis would
    # hide the lines at their x, so then the bars take the lower axis ("y", drawn on the right) and the
    # lines the overlaying one (drawn on the left), each side keeping its title
    flip = any(s.kind == "bar" and s.axis == "y2" for s in result.series)
    left, right = ("y2", "y") if flip else ("y", "y2")
    fig = go.Figure()
    colors: dict[str, str] = {}
    for series in result.series:
        base = series.name.split(" · ")[0]  # "setting · what": one colour per setting
        color = colors.setdefault(base, PALETTE[len(colors) % len(PALETTE)])
        common = dict(name=series.name, x=series.x, y=series.y, yaxis=right if series.axis == "y2" else left,
                      text=series.text)
        if series.kind == "bar":  # on the right axis a background to the lines, which may share its colour
            fig.add_trace(go.Bar(marker_color=color, textposition="none", opacity=0.3 if series.axis == "y2" else 1,
                                 width=0.5 if series.axis == "y2" else None, **common))
        else:
            fig.add_trace(go.Scatter(mode=series.kind, line=dict(color=color, dash=series.dash, shape=series.shape),
                                     marker=dict(color=color, size=7), textposition="top center", **common))
    axis = dict(gridcolor=GRID_COLOR, zeroline=False, linecolor="#d5dae1")
    log_ticks = dict(tickvals=LOG_TICKS, ticktext=[f"{v:g}" for v in LOG_TICKS])  # 1-2-5, whole numbers
    xs = [x for series in result.series for x in series.x]
    counted = all(isinstance(x, int) for x in xs) and max(xs, default=0) - min(xs, default=0) <= 12
    x_ticks = dict(type="log", **log_ticks) if result.log_x else dict(dtick=1) if counted else {}  # turns: 1, 2, 3
    fig.update_layout(
        title=dict(text=result.title, x=0.01, font=dict(size=14)), height=380, hovermode="closest",
        font=dict(family=FONT_FAMILY, size=12, color="#2a3240"), paper_bgcolor="white", plot_bgcolor="white",
        margin=dict(l=60, r=60 if result.y2_label else 15, t=50, b=50), barmode="stack",
        legend=dict(orientation="h", y=-0.2, x=0, yanchor="top"),
        xaxis=dict(title=dict(text=result.x_label), **x_ticks, **axis))
    left_axis = dict(title=dict(text=result.y_label), side="left",
                     **(dict(type="log", **log_ticks) if result.log_y else dict(rangemode="tozero")), **axis)
    # ticks of its own ("auto"): plotly.js 3 syncs an overlaying axis's ticks to the grid, at 4.16, 8.31, ...
    right_axis = dict(title=dict(text=result.y2_label), side="right", rangemode="tozero", tickmode="auto",
                      showgrid=False, zeroline=False)
    if flip:
        fig.update_layout(yaxis=right_axis, yaxis2=dict(left_axis, overlaying="y"))
    else:
        fig.update_layout(yaxis=left_axis, yaxis2=dict(right_axis, overlaying="y") if result.y2_label else None)
    return fig


# plotly.js 3 shows a "Share chart..." button that uploads the figure to Plotly Cloud unless told not to: a
# figure of this machine's measurements stays on it
PLOTLY_CONFIG = {"displaylogo": False, "showSendToCloud": False}


def write_html(fig: go.Figure, path: Path) -> Path:
    """The figure as a standalone HTML page with plotly.js inlined (opens offline)."""
    fig.write_html(path, include_plotlyjs=True, config=PLOTLY_CONFIG)
    return path


def write_image(fig: go.Figure, path: Path) -> Path:
    """The figure as PNG through kaleido (which drives a Chromium it finds, here Debian's), else as a
    standalone HTML page with plotly.js inlined (opens offline). Returns the file written."""
    if Path("/usr/bin/chromium").exists():
        os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")
    try:
        fig.write_image(path.with_suffix(".png"), width=1000, height=500)
        return path.with_suffix(".png")
    except Exception:  # no kaleido, or no browser for it: the interactive page instead
        return write_html(fig, path.with_suffix(".html"))
