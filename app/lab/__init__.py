"""The Optimization Lab: each classic prefill and decode optimization run both ways on the same prompt.

An experiment is a function (Lab, prompt) -> LabResult; run() times it, says what machine it ran on,
and the UI's Lab tab and `phasescope lab` draw and store what it returns. Experiments reach the
engine only through its public names and events, and measure it through Engine.variant(): the same
weights under another setting.
"""
from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..bench.load import LoadMeter
from ..bench.texts import LONG_TEXT, PARAGRAPH
from ..i18n import DEFAULT, t

from .figure import figure, write_html, write_image
from .lab import Lab, LabStopped
from .result import LabResult, Series, machine, said, settings_line, words

if TYPE_CHECKING:
    from engine import Engine


@dataclass(frozen=True)
class Experiment:
    name: str
    title_key: str  # its title in the UI's catalogues (app/i18n)
    runs: str  # "module.function" in this package, (Lab, prompt) -> LabResult
    default_prompt: str
    # what of the engine it needs: "lean", the lean forward's KV pool and switches (any architecture runs
    # the rest); "one_process", also that forward in this process, not tensor-parallel ranks (it times each
    # stage of the forward, or starts engines of its own); "native", also the native decode step there
    needs: str = ""

    def title(self, lang: str = DEFAULT) -> str:
        return t(lang, self.title_key)

    def run(self, lab: Lab, prompt: str) -> LabResult:
        """The experiment's modules import torch: they load when one first runs, not when the app lists them."""
        module, function = self.runs.split(".")
        return getattr(importlib.import_module(f"{__name__}.{module}"), function)(lab, prompt)


POEM = "Write a short poem about the sea."
EXPERIMENTS = {e.name: e for e in [
    Experiment("kv-cache", "lab.exp.kv_cache", "decode.kv_cache",
               "Explain what a KV cache is and why a language model needs one.", needs="lean"),
    Experiment("chunked-prefill", "lab.exp.chunked_prefill", "prefill.chunked_prefill",
               "Summarize the following notes on how language models serve many users at once. " * 4),
    Experiment("prefix-cache", "lab.exp.prefix_cache", "prefill.prefix_cache",
               "You are a patient teacher. A language model reads the prompt in one pass (prefill), filling a cache "
               "of keys and values, then writes one token per step (decode), reading every weight and the cache each "
               "time. Explain to a student why the second message of a chat can start faster than the first.",
               needs="lean"),
    Experiment("attention", "lab.exp.attention", "prefill.attention",
               "Attention lets every token look at every token before it. ", needs="lean"),
    Experiment("tensor-parallel", "lab.exp.tensor_parallel", "prefill.tensor_parallel",
               "Split every layer across two devices and add the partial results. ", needs="one_process"),
    Experiment("speculative", "lab.exp.speculative", "decode.speculative", PARAGRAPH, needs="lean"),
    # a story that does not repeat itself: what a window forgets is gone for good
    Experiment("kv-compression", "lab.exp.kv_compression", "decode.kv_compression",
               " ".join(LONG_TEXT.read_text(encoding="utf-8").split()[:900]), needs="lean"),
    Experiment("batching", "lab.exp.batching", "decode.batching", POEM),
    Experiment("flash-decoding", "lab.exp.flash_decoding", "decode.flash_decoding", PARAGRAPH, needs="one_process"),
    Experiment("precision", "lab.exp.precision", "decode.precision", POEM, needs="one_process"),
    Experiment("stages", "lab.exp.stages", "profile.stages",
               "Explain where the time goes when a language model answers a question. ", needs="one_process"),
    Experiment("roofline", "lab.exp.roofline", "profile.roofline",
               "A roofline shows whether a step is limited by compute or by memory bandwidth. "),
    Experiment("threads", "lab.exp.threads", "threads.threads",
               "Every matrix product is shared out among the threads, and the step waits for the last of them. ",
               needs="native"),
]}


def prompt_for(name: str, prompt: str | None) -> str:
    """The prompt an experiment runs: the one given, or its own where none (or only spaces) is."""
    return prompt if prompt and prompt.strip() else EXPERIMENTS[name].default_prompt


def cannot_run(engine: Engine, name: str, lang: str = DEFAULT) -> str:
    """Why an experiment cannot run on this engine, in one line ("" where it can): it needs the lean forward
    and the model runs on transformers', or it needs that forward in this process and it runs in
    tensor-parallel ranks, or it needs the native decode step and the forward runs without one."""
    needs = EXPERIMENTS[name].needs
    if needs and engine.info.model_path != "lean-llama":
        key = "lab.needs_lean"
    elif needs in ("one_process", "native") and not getattr(engine.runner, "explains", False):
        key = "lab.needs_one_process"
    elif needs == "native" and getattr(engine.runner, "fused", None) is None:
        key = "lab.needs_native"
    else:
        return ""
    return t(lang, key, title=EXPERIMENTS[name].title(lang), model=engine.info.name)


def run(engine: Engine, name: str, prompt: str | None = None, quick: bool = False,
        progress: Callable[[str], None] | None = None, stop=None) -> LabResult:
    """Run one experiment on the engine (on the thread that steps it; not while it serves) and return its
    result, timed and with the machine it ran on, and how busy the rest of it was meanwhile. Raises LabStopped
    when stop is set between measurements."""
    if refusal := cannot_run(engine, name):
        raise ValueError(refusal)
    start, load = time.perf_counter(), LoadMeter()
    result = EXPERIMENTS[name].run(Lab(engine, quick, progress, stop), prompt_for(name, prompt))
    result.seconds, result.quick = round(time.perf_counter() - start, 2), quick
    result.machine = {**machine(engine), **load.since()}
    return result


__all__ = ["EXPERIMENTS", "Experiment", "LabResult", "LabStopped", "Series", "cannot_run", "figure", "prompt_for",
           "run", "said", "settings_line", "words", "write_html", "write_image"]
