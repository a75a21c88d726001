"""The Optimization Lab: each classic prefill and decode optimization run both ways on the same prompt.

An experiment is a function (Lab, prompt) -> LabResult; run() times it, says what machine it ran on,
and the UI's Lab tab and `phasescope lab` draw and store what it returns. Experiments reach the
engine only through its public names and events, and measure it through Engine.variant(): the same
weights under another setting.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine import Engine

from ..i18n import DEFAULT, t

from . import decode, prefill, profile
from .figure import figure, write_image
from .lab import Lab, LabStopped
from .result import LabResult, Series, machine


@dataclass(frozen=True)
class Experiment:
    name: str
    title_key: str  # its title in the UI's catalogues (app/i18n)
    run: Callable[[Lab, str], LabResult]
    default_prompt: str

    def title(self, lang: str = DEFAULT) -> str:
        return t(lang, self.title_key)


_DEFAULTS = {**prefill.DEFAULT_PROMPTS, **decode.DEFAULT_PROMPTS, **profile.DEFAULT_PROMPTS}
EXPERIMENTS = {e.name: e for e in [
    Experiment("kv-cache", "lab.exp.kv_cache", decode.kv_cache, _DEFAULTS["kv-cache"]),
    Experiment("chunked-prefill", "lab.exp.chunked_prefill", prefill.chunked_prefill, _DEFAULTS["chunked-prefill"]),
    Experiment("prefix-cache", "lab.exp.prefix_cache", prefill.prefix_cache, _DEFAULTS["prefix-cache"]),
    Experiment("attention", "lab.exp.attention", prefill.attention, _DEFAULTS["attention"]),
    Experiment("tensor-parallel", "lab.exp.tensor_parallel", prefill.tensor_parallel, _DEFAULTS["tensor-parallel"]),
    Experiment("speculative", "lab.exp.speculative", decode.speculative, _DEFAULTS["speculative"]),
    Experiment("kv-compression", "lab.exp.kv_compression", decode.kv_compression, _DEFAULTS["kv-compression"]),
    Experiment("batching", "lab.exp.batching", decode.batching, _DEFAULTS["batching"]),
    Experiment("flash-decoding", "lab.exp.flash_decoding", decode.flash_decoding, _DEFAULTS["flash-decoding"]),
    Experiment("precision", "lab.exp.precision", decode.precision, _DEFAULTS["precision"]),
    Experiment("stages", "lab.exp.stages", profile.stages, _DEFAULTS["stages"]),
    Experiment("roofline", "lab.exp.roofline", profile.roofline, _DEFAULTS["roofline"]),
]}


def run(engine: Engine, name: str, prompt: str | None = None, quick: bool = False,
        progress: Callable[[str], None] | None = None, stop=None) -> LabResult:
    """Run one experiment on the engine (on the thread that steps it; not while it serves) and return its
    result, timed and with the machine it ran on. Raises LabStopped when stop is set between measurements."""
    experiment = EXPERIMENTS[name]
    prompt = prompt if prompt and prompt.strip() else experiment.default_prompt
    start = time.perf_counter()
    result = experiment.run(Lab(engine, quick, progress, stop), prompt)
    result.seconds, result.quick, result.machine = round(time.perf_counter() - start, 2), quick, machine(engine)
    return result


__all__ = ["EXPERIMENTS", "Experiment", "LabResult", "LabStopped", "Series", "figure", "run", "write_image"]
