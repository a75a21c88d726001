"""A lab result's figure: its series overlaid in one Plotly figure, drawn from the stored result alone."""
from __future__ import annotations

import os
from pathlib import Path

import plotly.graph_objects as go

from ..i18n import DEFAULT
from ..ui.charts import FONT_FAMILY, GRID_COLOR
from .result import LabResult

# one colour per setting, in the order the experiment lists them (the first is the baseline)
PALETTE = ["#7d8796", "#2f6fdf", "#e8871e", "#2a9d61", "#b24bd1", "#d64545", "#16a3b8", "#8a6d3b"]


def figure(result: LabResult, lang: str = DEFAULT) -> go.Figure:
    """The run's figure, its words in lang."""
    result = result.in_language(lang)
    fig = go.Figure()
    colors: dict[str, str] = {}
    for series in result.series:
        base = series.name.split(" · ")[0]  # "setting · what": one colour per setting
        color = colors.setdefault(base, PALETTE[len(colors) % len(PALETTE)])
        common = dict(name=series.name, x=series.x, y=series.y, yaxis="y2" if series.axis == "y2" else "y",
                      text=series.text)
        if series.kind == "bar":
            fig.add_trace(go.Bar(marker_color=color, textposition="none", **common))
        else:
            fig.add_trace(go.Scatter(mode=series.kind, line=dict(color=color, dash=series.dash, shape=series.shape),
                                     marker=dict(color=color, size=7), textposition="top center", **common))
    axis = dict(gridcolor=GRID_COLOR, zeroline=False, linecolor="#d5dae1")
    fig.update_layout(
        title=dict(text=result.title, x=0.01, font=dict(size=14)), height=380, hovermode="closest",
        font=dict(family=FONT_FAMILY, size=12, color="#2a3240"), paper_bgcolor="white", plot_bgcolor="white",
        margin=dict(l=60, r=60 if result.y2_label else 15, t=50, b=50), barmode="stack",
        legend=dict(orientation="h", y=-0.2, x=0, yanchor="top"),
        xaxis=dict(title=dict(text=result.x_label), type="log" if result.log_x else None, **axis),
        yaxis=dict(title=dict(text=result.y_label), type="log" if result.log_y else None,
                   rangemode="normal" if result.log_y else "tozero", **axis))
    if result.y2_label:
        fig.update_layout(yaxis2=dict(title=dict(text=result.y2_label), overlaying="y", side="right",
                                      rangemode="tozero", showgrid=False, zeroline=False))
    return fig


def write_image(fig: go.Figure, path: Path) -> Path:
    """The figure as PNG through kaleido (which drives a Chromium it finds, here Debian's), else as a
    standalone HTML page with plotly.js inlined (opens offline). Returns the file written."""
    if Path("/usr/bin/chromium").exists():
        os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")
    try:
        fig.write_image(path.with_suffix(".png"), width=1000, height=500)
        return path.with_suffix(".png")
    except Exception:  # no kaleido, or no browser for it: the interactive page instead
        fig.write_html(path.with_suffix(".html"), include_plotlyjs=True)
        return path.with_suffix(".html")
