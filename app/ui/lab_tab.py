"""The Lab tab: pick an optimization, press Run, and see both settings on the same prompt in one figure,
with the measured numbers, what to look for in them, and the machine they came from (app/lab).

An experiment runs on the engine's own thread between two scheduler steps (Engine.call), so chats wait
while it measures: they would otherwise share the cores with it and spoil both. Progress shows as it
goes; Stop ends it after the measurement in progress. Each run is saved (lab_runs) to reopen or export.
"""
from __future__ import annotations

import functools
import json
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import gradio as gr

from .. import lab
from ..history.store import Store, StoreError
from ..i18n import DEFAULT, K, t
from .history_tab import download_when_written, export_folder
from .language import Texts, user_error
from .loading import loading_line

if TYPE_CHECKING:  # the engine's machinery imports torch: the page is served before it loads
    from engine import Engine

FIRST = "kv-cache"


@functools.cache
def exports_folder() -> Path:
    """Where the download files of the runs shown are written: a private folder, made at the first and
    removed when the process exits, as the History tab's (a shared one in /tmp kept 4.8 MB per run shown for
    good, and another user could have made it first)."""
    return export_folder()


def _experiment_choices(lang: str) -> list[tuple[str, str]]:
    return [(e.title(lang), e.name) for e in lab.EXPERIMENTS.values()]


def _run_choices(store: Store, lang: str = DEFAULT) -> list[tuple[str, int]]:
    runs = store.lab_runs()
    titles = {name: e.title(lang) for name, e in lab.EXPERIMENTS.items()}
    return [(f"#{row['id']} · {titles.get(row['experiment'], row['experiment'])} · "
             f"{row['created_at'][:19].replace('T', ' ')}", row["id"]) for row in runs]


def _runs_list(store: Store, lang: str, value: int | None = None) -> list:
    """The saved runs' list and its Open button: both off, with a line that says why, until a run is saved
    (or while the database cannot be read: "none yet" said of a damaged one)."""
    try:
        choices, why = _run_choices(store, lang), t(lang, "lab.no_runs")
    except StoreError as exc:
        choices, why = [], t(lang, "error.other", detail=exc)
    return [gr.Dropdown(choices=choices, value=value, interactive=bool(choices), info=None if choices else why),
            gr.Button(interactive=bool(choices))]


EXPORTS = ("json", "html")  # the run as JSON, its figure as a standalone page


def write_export(kind: str, shown: tuple[dict, int | None], lang: str) -> Path:
    """The run on show as JSON, or its figure as a standalone page (plotly.js inlined: it opens offline; the
    figure's own camera button saves a PNG), in lang. Written when its button is clicked, not whenever a
    run is shown: the page is 4.8 MB, which a shown run kept in the temporary folder (often memory) until
    the app ended, and 50-150 ms of every run shown or language switch."""
    data, run_id = shown
    result = lab.LabResult.from_dict(data)
    path = exports_folder() / f"lab-{run_id or 'unsaved'}-{result.experiment}-{lang}.{kind}"
    if kind == "json":
        path.write_text(json.dumps(result.in_language(lang).to_dict(), indent=1, ensure_ascii=False),
                        encoding="utf-8")
    else:
        lab.write_html(lab.figure(result, lang), path)
    return path


def _show(result: lab.LabResult, run_id: int | None, lang: str) -> list:
    """status, plot, report, the two download buttons, and the run shown (drawn again in another language)."""
    status = t(lang, "lab.done", seconds=result.seconds, run=run_id or "-") if run_id else t(lang, "lab.not_saved")
    return [status, gr.Plot(lab.figure(result, lang), visible=True), result.markdown(lang),
            *[gr.Button(visible=True) for _ in EXPORTS], (result.to_dict(), run_id)]


def build(engine: Engine, store: Store, texts: Texts, lang: gr.Radio) -> None:
    stops = gr.State(None)  # one Stop event per Run clicked in this tab (running or waiting its turn)
    shown_run = gr.State(None)  # (result as a dict, run id) of the run on show
    with gr.Row(equal_height=True):
        experiment = texts(gr.Dropdown, choices=_experiment_choices(DEFAULT), value=FIRST, label=K("lab.experiment"),
                           scale=3, elem_id="ps-lab-experiment")
        quick = texts(gr.Checkbox, value=False, label=K("lab.quick"), scale=1, elem_id="ps-lab-quick")
        run = texts(gr.Button, value=K("lab.run"), variant="primary", scale=1, elem_id="ps-lab-run")
        stop = texts(gr.Button, value=K("lab.stop"), variant="stop", scale=1, elem_id="ps-lab-stop")
    prompt = texts(gr.Textbox, value=lab.EXPERIMENTS[FIRST].default_prompt, label=K("lab.prompt"), lines=2,
                   max_lines=6, elem_id="ps-lab-prompt")
    loading_line(engine, texts, "ps-lab-loading")  # what the model's load does, while it loads
    status = texts(gr.Markdown, value=K("lab.intro"), elem_id="ps-lab-status")  # the intro again on a switch
    plot = gr.Plot(visible=False, show_label=False, elem_id="ps-lab-plot")
    report = gr.Markdown(elem_id="ps-lab-report")
    with gr.Row(equal_height=True):
        # drawn with the saved runs when the page loads (redraw)
        runs = texts(gr.Dropdown, choices=[], value=None, label=K("lab.saved"), scale=3, elem_id="ps-lab-runs")
        reopen = texts(gr.Button, value=K("lab.open"), scale=1, elem_id="ps-lab-open")
        json_file = texts(gr.Button, value=K("lab.export_json"), visible=False, scale=1, elem_id="ps-lab-json")
        html_file = texts(gr.Button, value=K("lab.export_figure"), visible=False, scale=1, elem_id="ps-lab-html")
    # the file a button above asks for, written at its click, then downloaded through this button, which the
    # page clicks (as the History tab's files of all sessions)
    download = gr.DownloadButton(visible="hidden", elem_id="ps-lab-file")
    shown = [status, plot, report, json_file, html_file, shown_run]

    def say(line: str) -> list:
        """Only the status line of on_run's outputs (shown, the saved runs' list and Open) changes."""
        return [line, *[gr.skip()] * (len(shown) + 1)]

    def on_run(events, name, text, is_quick, lang_choice):
        """events: the tab's Stop events, the last this run's, made at its click, so that a Stop while the
        run waits its turn (behind another tab's run) ends it before it begins."""
        event = events[-1]
        if event.is_set():
            yield say(t(lang_choice, "lab.stopped"))
            return
        progress, outcome = queue.SimpleQueue(), {}

        def work() -> None:
            try:
                # said at once (the engine's turn is not waited for); reading the engine waits for its load
                outcome["refused"] = lab.cannot_run(engine, name, lang_choice)
                if not outcome["refused"]:
                    outcome["result"] = engine.call(lambda: lab.run(engine, name, text, is_quick, progress.put,
                                                                    event),
                                                    name="lab")  # the chats' phase line says what they wait for
            except BaseException as exc:  # shown to the user below
                outcome["error"] = exc

        worker = threading.Thread(target=work, name="lab", daemon=True)
        worker.start()
        yield say(t(lang_choice, "lab.waiting"))
        while worker.is_alive():
            worker.join(0.25)
            line = None
            while not progress.empty():
                line = progress.get()
            if line:
                yield say(t(lang_choice, "lab.running", step=lab.words(lang_choice, line)))
        error = outcome.get("error")
        if outcome.get("refused"):  # the experiment needs what this engine lacks
            yield say(outcome["refused"])
            return
        if isinstance(error, lab.LabStopped):
            yield say(t(lang_choice, "lab.stopped"))
            return
        if error is not None:
            yield say(t(lang_choice, "lab.failed", detail=user_error(lang_choice, error)))
            return
        result, run_id = outcome["result"], None
        try:
            run_id = store.add_lab_run(name, {"prompt": result.prompt, "quick": result.quick, **result.settings},
                                       result.machine, result.to_dict())
        except Exception as exc:  # a full disk or a broken database: the result is still shown
            gr.Warning(t(lang_choice, "lab.save_failed", detail=str(exc)))
        yield [*_show(result, run_id, lang_choice), *_runs_list(store, lang_choice, run_id)]

    def on_open(run_id, lang_choice):
        """The saved run, and the experiment, prompt and size it ran with (Run repeats it)."""
        if run_id is None:
            gr.Warning(t(lang_choice, "lab.pick_first"))  # a queued event: Gradio shows it as a toast
            return [gr.skip()] * (len(shown) + 3)  # shown, the experiment, prompt and size
        try:
            row = store.lab_run(int(run_id))
        except StoreError as exc:
            gr.Warning(t(lang_choice, "error.other", detail=str(exc)))
            return [gr.skip()] * (len(shown) + 3)
        result = lab.LabResult.from_dict(row["results"])
        known = result.experiment in lab.EXPERIMENTS  # a run saved by a later version may name another
        return [*_show(result, row["id"], lang_choice), result.experiment if known else gr.skip(), result.prompt,
                result.quick]

    def redraw(lang_choice, current, run, shown_now):
        """A language switch: the lists relabelled, and the run on show drawn again in the new language."""
        lists = [gr.Dropdown(choices=_experiment_choices(lang_choice), value=current),
                 *_runs_list(store, lang_choice, run)]
        if not shown_now:
            return [*lists, *[gr.skip()] * len(shown)]
        data, run_id = shown_now
        return [*lists, *_show(lab.LabResult.from_dict(data), run_id, lang_choice)]

    # input, not change: a language switch relabels the list without resetting an edited prompt
    experiment.input(lambda name: lab.EXPERIMENTS[name].default_prompt, [experiment], [prompt], queue=False)
    def stop_all(events):
        for event in events or []:
            event.set()

    # Stop sets the event of every Run clicked in this tab: a click while a run goes on adds one (Gradio
    # starts no second run for it), and the running one must still stop
    armed = run.click(lambda events: [*(events or []), threading.Event()], [stops], [stops], queue=False)
    armed.then(on_run, [stops, experiment, prompt, quick, lang], [*shown, runs, reopen], concurrency_limit=1,
               concurrency_id="lab")
    run.click(lab.prompt_for, [experiment, prompt], [prompt], queue=False)  # an emptied box shows what runs
    stop.click(stop_all, [stops], None, queue=False)
    reopen.click(on_open, [runs, lang], [*shown, experiment, prompt, quick])
    texts.on_switch(redraw, [experiment, runs, shown_run], [experiment, runs, reopen, *shown])

    def export(kind, shown_now, lang_choice):
        if not shown_now:
            return gr.DownloadButton(value=None, interactive=False)
        try:
            return gr.DownloadButton(value=str(write_export(kind, shown_now, lang_choice)), interactive=True)
        except OSError as exc:  # a full disk or an unwritable temporary folder
            gr.Warning(t(lang_choice, "lab.export_failed", detail=exc))
            return gr.DownloadButton(value=None, interactive=False)

    for kind, button in zip(EXPORTS, (json_file, html_file)):
        # queued: Gradio shows a queued event's gr.Warning as a toast
        download_when_written(button.click(functools.partial(export, kind), [shown_run, lang], [download]), download)
