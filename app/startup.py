"""A start without Python's garbage collector passing over torch's and gradio's imports.

Importing torch (and gradio, for the app) makes millions of objects that live as long as the process
and almost no garbage. The collector runs every 700 new objects, and now and then over every object
there is. On the 2-core machine `phasescope generate` made 390 passes before its first token, three of
them over everything (15, 40 and 69 ms): 0.19 s of a 1.5 s cold start. `phasescope ui` made six such
passes, 0.53 s. So the commands whose start is timed (generate, ui, serve) turn the collector off first
thing (pause_collector), and on again once the engine's modules are imported (settle). Then what the
imports made moves to the collector's permanent generation, which no pass reads again. The model loads
with the collector on: a first run's GGUF conversion makes garbage.
"""
from __future__ import annotations

import gc


def pause_collector() -> None:
    gc.disable()


def settle() -> None:
    """The imports are done: their objects are frozen out of the collector's passes, and it runs again.
    Only after pause_collector: a caller that kept the collector on (the tests, a notebook) keeps its
    objects where they are."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
