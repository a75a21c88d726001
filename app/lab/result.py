"""What one lab run measured: the series of its figure, a table of numbers, an explanation tied to those
numbers, and the effects it is about, each checked (the direction the lesson predicts).

A result is plain data (JSON both ways), so that a stored run is drawn again exactly as it was.
"""
from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field


@dataclass
class Series:
    """One trace of the figure. kind: lines, markers, lines+markers or bar (bars at the same x stack);
    axis: y or y2 (the right one). A name "setting · what" takes the setting's colour."""

    name: str
    x: list
    y: list
    kind: str = "lines+markers"
    axis: str = "y"
    text: list | None = None
    dash: str | None = None
    shape: str | None = None  # a line's shape between points: "vh" draws each y over the x-span before it


@dataclass
class LabResult:
    experiment: str
    title: str
    prompt: str
    settings: dict  # what was compared, and the run's sizes
    x_label: str
    y_label: str
    series: list[Series]
    table: list[dict]  # rows of measured numbers, one column per key
    explanation: str  # two or three sentences tied to the numbers above
    effects: dict[str, bool]  # each effect the experiment is about: did it show, in this run's numbers
    timed: list[str] = field(default_factory=list)  # the effects read off a clock: a busy machine can hide them
    y2_label: str | None = None
    log_x: bool = False
    log_y: bool = False
    machine: dict = field(default_factory=dict)
    seconds: float = 0.0
    quick: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LabResult:
        return cls(**{**data, "series": [Series(**s) for s in data["series"]]})

    @property
    def shows_its_effect(self) -> bool:
        return all(self.effects.values())

    @property
    def counted_effects(self) -> dict[str, bool]:
        """The effects read off counts (tokens, bytes, FLOPs), which no load on the machine changes."""
        return {effect: ok for effect, ok in self.effects.items() if effect not in self.timed}

    def markdown(self) -> str:
        """The run as Markdown: title, table, explanation, effects, settings and machine."""
        lines = [f"## {self.title}", ""]
        if self.table:
            columns = list(self.table[0])
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in self.table]
            lines.append("")
        lines += [self.explanation, ""]
        lines += [f"- {'shown' if ok else 'NOT shown'}: {effect}{' (timed)' if effect in self.timed else ''}"
                  for effect, ok in self.effects.items()]
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        lines += ["", f"Settings: {settings}. Machine: {machine_line(self.machine)}. Took {self.seconds:.1f} s."]
        return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return "" if value is None else str(value).replace("|", "\\|")


def processor_name(device) -> str:
    import torch  # here: the app lists saved runs before torch has loaded

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(engine) -> dict:
    """The machine and the engine a run measured: enough to tell two runs' conditions apart."""
    import torch

    info = engine.info
    return {"device": info.device, "processor": processor_name(engine.loaded.device), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "model": info.name, "precision": info.precision, "decode": info.decode_path, "torch": torch.__version__}


def machine_line(m: dict) -> str:
    if not m:
        return "unknown"
    return (f"{m.get('processor')} ({m.get('cores')} cores, {m.get('threads')} threads), {m.get('model')} "
            f"in {m.get('precision')}, decode: {m.get('decode')}, torch {m.get('torch')}")
