"""What one lab run measured: the series of its figure, a table of numbers, an explanation tied to those
numbers, and the effects it is about, each checked (the direction the lesson predicts).

A result is plain data (JSON both ways), so that a stored run is drawn again exactly as it was, in the
language the page shows: its words are kept as catalogue keys with their numbers (see said and words),
and put in a language only when drawn.
"""
from __future__ import annotations

import os
import platform
import re
from dataclasses import asdict, dataclass, field, replace

from ..i18n import DEFAULT, catalogue, t


def said(key: str, **fields) -> list:
    """A text of the catalogues with its fields, as a result keeps it: [key, fields]. A field may be such
    a text itself."""
    return [key, fields]


def words(lang: str, text):
    """text in lang: a catalogue key, or [key, fields] from said; anything else (numbers, names, the
    English of runs stored before the Lab spoke two languages) as it is."""
    if isinstance(text, list) and len(text) == 2 and isinstance(text[0], str) and isinstance(text[1], dict):
        key, fields = text
        return t(lang, key, **{name: words(lang, value) for name, value in fields.items()})
    if isinstance(text, str) and text in catalogue(DEFAULT):
        return t(lang, text)
    return text


@dataclass
class Series:
    """One trace of the figure. kind: lines, markers, lines+markers or bar (bars at the same x stack);
    axis: y or y2 (the right one). A name "setting · what" (lab.series) takes the setting's colour."""

    name: str | list
    x: list
    y: list
    kind: str = "lines+markers"
    axis: str = "y"
    text: list | None = None
    dash: str | None = None
    shape: str | None = None  # a line's shape between points: "vh" draws each y over the x-span before it


@dataclass
class LabResult:
    """Its words (title, labels, series names, the table's columns and names, the explanation, the
    effects) are catalogue keys or said(...), put in a language by in_language."""

    experiment: str
    title: str | list
    prompt: str
    settings: dict  # what was compared, and the run's sizes
    x_label: str | list
    y_label: str | list
    series: list[Series]
    table: list[dict]  # rows of measured numbers, one column per key
    explanation: str | list  # two or three sentences tied to the numbers above
    effects: dict[str, bool]  # each effect the experiment is about: did it show, in this run's numbers
    timed: list[str] = field(default_factory=list)  # the effects read off a clock: a busy machine can hide them
    y2_label: str | list | None = None
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

    def in_language(self, lang: str) -> LabResult:
        """The same run with its words in lang (plain text, which words() leaves as it is)."""
        def say(text):
            return words(lang, text)

        return replace(
            self, title=say(self.title), x_label=say(self.x_label), y_label=say(self.y_label),
            y2_label=say(self.y2_label), explanation=say(self.explanation),
            series=[replace(s, name=say(s.name), x=[say(x) for x in s.x], text=s.text and [say(x) for x in s.text])
                    for s in self.series],
            table=[{say(column): say(value) for column, value in row.items()} for row in self.table],
            effects={say(effect): ok for effect, ok in self.effects.items()}, timed=[say(e) for e in self.timed])

    def markdown(self, lang: str = DEFAULT) -> str:
        """The run as Markdown, in lang: title, table, explanation, effects, settings and machine."""
        run = self.in_language(lang)
        lines = [f"## {run.title}", ""]
        if run.table:
            columns = list(run.table[0])
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(lang, row.get(c)) for c in columns) + " |" for row in run.table]
            lines.append("")
        lines += [run.explanation, ""]
        lines += [t(lang, "lab.md.effect_timed" if effect in run.timed else "lab.md.effect",
                    shown=t(lang, "lab.md.shown" if ok else "lab.md.not_shown"), effect=effect)
                  for effect, ok in run.effects.items()]
        lines += ["", t(lang, "lab.md.footer", settings=settings_line(lang, self.settings),
                        machine=machine_line(lang, self.machine), seconds=self.seconds)]
        return "\n".join(lines)


# How a run's settings are said: each name the experiments use (and the chunk "whole") to its catalogue key
SETTING_WORDS = {
    "prompt_tokens": "lab.setting.prompt_tokens", "new_tokens": "lab.setting.new_tokens",
    "draft_tokens": "lab.setting.draft_tokens", "context_tokens": "lab.setting.context_tokens",
    "window": "lab.setting.window", "sinks": "lab.setting.sinks", "levels": "lab.setting.levels",
    "contexts": "lab.setting.contexts", "native_step": "lab.setting.native_step",
    "machine_read_gb_s": "lab.setting.machine_read_gb_s", "long_prompt_tokens": "lab.setting.long_prompt_tokens",
    "chunks": "lab.setting.chunks", "turns": "lab.setting.turns", "lengths": "lab.setting.lengths",
    "precision": "lab.setting.precision", "decode_steps": "lab.setting.decode_steps",
    "stages_over_prefill": "lab.setting.stages_over_prefill", "stages_over_decode": "lab.setting.stages_over_decode",
    "batches": "lab.setting.batches", "peak_gflops": "lab.setting.peak_gflops",
    "bandwidth_gbs": "lab.setting.bandwidth_gbs", "whole": "lab.setting.whole", "runs": "lab.setting.runs",
    "forward_threads": "lab.setting.forward_threads",
}


def settings_line(lang: str, settings: dict) -> str:
    """A run's settings in words, e.g. "context lengths 256, 1,024 · native decode step yes": each name and
    value as SETTING_WORDS says it, anything else (a run stored by an older version) as it was kept."""
    return t(lang, "lab.md.setting_sep").join(f"{_setting(lang, name)} {_setting_value(lang, value)}"
                                              for name, value in settings.items())


def _setting(lang: str, text: str) -> str:
    if threads := re.fullmatch(r"(\d+) threads?", text):  # a read rate's key: ReadProbe.labels
        return t(lang, "lab.setting.one_thread" if threads[1] == "1" else "lab.setting.threads", n=int(threads[1]))
    return t(lang, SETTING_WORDS[text]) if text in SETTING_WORDS else text.replace("_", " ")


def _setting_value(lang: str, value) -> str:
    if isinstance(value, dict):
        return t(lang, "lab.md.list_sep").join(f"{_setting(lang, k)} {_cell(lang, v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return t(lang, "lab.md.list_sep").join(_setting_value(lang, v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, str):
        return t(lang, SETTING_WORDS[value]) if value in SETTING_WORDS else value
    return _cell(lang, value)


def _cell(lang: str, value) -> str:
    if isinstance(value, bool):
        return t(lang, "lab.md.yes" if value else "lab.md.no")
    if isinstance(value, float):  # three figures, as measured: 164, 89.6, 18.5, 0.0183 (not 89.60 under 164)
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
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


def machine_line(lang: str, m: dict) -> str:
    """The machine and engine a run measured, and how busy the rest of the machine was meanwhile (a run saved
    before 2026-12-07 does not say)."""
    if not m:
        return t(lang, "lab.md.unknown_machine")
    line = t(lang, "lab.md.machine", **{key: m.get(key) for key in
                                        ("processor", "cores", "threads", "model", "precision", "decode", "torch")})
    if "others_cores" in m:
        line += t(lang, "lab.md.load", others=m["others_cores"], steal=m["steal_cores"])
    return line
