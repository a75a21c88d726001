"""The Optimization Lab: every experiment from the command line on the bundled model, each showing the
effect it is about in its own numbers; the results stored, drawn and exported."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app import lab
from app.history.store import Store
from engine import DecodeStep, Engine, EngineConfig, Finished, SamplingParams, Status

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_all(tmp_path_factory):
    """`phasescope lab all --quick --output json`, as a user runs it, with its database file."""
    db = tmp_path_factory.mktemp("lab") / "history.db"
    out = subprocess.run([sys.executable, "-m", "app.cli", "lab", "all", "--quick", "--output", "json", "--db",
                          str(db)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), db


@pytest.mark.sweep
@pytest.mark.model
def test_lab_all_quick_every_experiment_shows_its_effect(quick_all):
    results, db = quick_all
    assert list(results) == list(lab.EXPERIMENTS)
    for name, data in results.items():
        result = lab.LabResult.from_dict(data)
        assert result.experiment == name and result.quick and result.machine["model"]
        assert result.series and all(len(s.x) == len(s.y) > 0 for s in result.series), name
        assert result.table and result.explanation and result.effects, name
        assert set(result.timed) <= set(result.effects), name
        # what is counted shows in every run: the same tokens with and without the cache, int8 KV in fewer
        # bytes, more than one token per forward with a draft, cached tokens on later turns, ...
        assert all(result.counted_effects.values()), (name, result.effects, result.table)
        assert len(lab.figure(result).data) == len(result.series)
    roofline = results["roofline"]["settings"]
    assert roofline["peak_gflops"] > 0 and roofline["bandwidth_gbs"] > 0
    saved = Store.open(db).lab_runs()
    assert sorted(row["experiment"] for row in saved) == sorted(lab.EXPERIMENTS)


@pytest.mark.timed
@pytest.mark.model
def test_lab_all_quick_shows_the_timed_effects_on_a_quiet_machine(quick_all):
    """The direction of each timed effect (no-cache slower at the end than at the start, the prefix cache
    lowers the second turn's TTFT, batching raises throughput...): a busy machine can flip them, so
    this runs by `make timed` and not in `make test`."""
    results, _ = quick_all
    for name, data in results.items():
        result = lab.LabResult.from_dict(data)
        assert result.shows_its_effect, (name, result.effects, result.table)
    stages = results["stages"]["settings"]
    assert 0.9 <= stages["stages_over_prefill"] <= 1.1 and 0.9 <= stages["stages_over_decode"] <= 1.1


@pytest.mark.sweep
@pytest.mark.model
def test_a_stored_run_comes_back_whole_and_exports(quick_all, tmp_path):
    _, db = quick_all
    store = Store.open(db)
    row = store.lab_run(store.lab_runs()[0]["id"])
    result = lab.LabResult.from_dict(row["results"])
    assert row["experiment"] == result.experiment and row["machine"] == result.machine
    assert result.markdown().startswith(f"## {lab.words('en', result.title)}")
    chinese = result.markdown("zh")
    assert chinese.startswith(f"## {lab.words('zh', result.title)}") and "已显示" in chinese
    written = lab.write_image(lab.figure(result), tmp_path / result.experiment)
    assert written.suffix in (".png", ".html") and written.stat().st_size > 1000


@pytest.mark.model
def test_cli_names_the_experiments_and_refuses_an_unknown_one():
    listing = subprocess.run([sys.executable, "-m", "app.cli", "lab", "list"], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
    assert listing.returncode == 0 and all(name in listing.stdout for name in lab.EXPERIMENTS)
    wrong = subprocess.run([sys.executable, "-m", "app.cli", "lab", "kv-cach"], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines()[-1].startswith("phasescope: error: no experiment 'kv-cach'")


def test_experiments_that_need_the_lean_forward_are_said_so_and_all_runs_the_others(gpt2_folder, tmp_path):
    """GPT-2 runs on transformers' forward: an experiment that needs the lean one (its KV pool, switches or
    stage times) is refused in one line, before it measures anything; `all` leaves those out and runs the
    rest, which measure it as they do the lean one."""
    from engine import load_model

    gpt2 = Engine(load_model(str(gpt2_folder), "cpu", "float32", lean=True))
    with pytest.raises(ValueError) as refused:  # `phasescope lab stages`: this line, exit 2
        lab.run(gpt2, "stages", quick=True)
    assert str(refused.value) == (
        "“Where the time goes” needs the lean forward of the Llama family (Llama, SmolLM, Mistral, Qwen2), its "
        f"KV pool and switches; {gpt2_folder.name} runs on transformers' forward.")
    assert lab.cannot_run(gpt2, "stages", "zh").startswith("「时间花在哪里」需要")
    every = subprocess.run([sys.executable, "-m", "app.cli", "lab", "all", "--quick", "--model", str(gpt2_folder),
                            "--db", str(tmp_path / "h.db"), "--output", "json"], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert every.returncode == 0, every.stderr[-2000:]
    ran = set(json.loads(every.stdout))
    assert {"chunked-prefill", "batching", "roofline"} == ran
    assert all(f"lab {name}: left out: “" in every.stderr for name in set(lab.EXPERIMENTS) - ran)


def test_a_png_option_naming_a_file_is_refused_before_the_model_loads(tmp_path):
    (tmp_path / "figures").write_text("not a folder")
    out = subprocess.run([sys.executable, "-m", "app.cli", "lab", "batching", "--png", str(tmp_path / "figures"),
                          "--db", str(tmp_path / "h.db")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "Loading" not in out.stderr
    assert out.stderr.strip() == f"phasescope: error: --png takes a folder, and {tmp_path / 'figures'} is a file"


def test_stop_ends_a_run_between_measurements(tiny):
    engine = Engine(tiny, EngineConfig())
    stop = threading.Event()
    seen = []

    def progress(text: str) -> None:
        seen.append(text)
        stop.set()  # asked to stop while the first measurement runs

    with pytest.raises(lab.LabStopped):
        lab.run(engine, "batching", quick=True, progress=progress, stop=stop)
    assert len(seen) == 1


def test_a_chat_stopped_while_it_waits_for_a_run_ends_at_the_runs_next_measurement(tiny):
    """A run holds the engine's thread; a reply waiting for it that the user stops ends between two of its
    measurements, not when the whole run is over."""
    engine = Engine(tiny, EngineConfig())
    waiting = engine.new_request_from_ids([5, 6, 7])
    events = []
    engine.submit(waiting, [events.append])
    ended_at = []

    def progress(text) -> None:
        if not ended_at:
            waiting.cancel()  # Stop, pressed during the first measurement
        ended_at.append(bool(events))

    result = lab.run(engine, "batching", quick=True, progress=progress)
    assert result.experiment == "batching" and ended_at[:2] == [False, True]  # at the second measurement
    assert events[-1].reason == "cancelled" and waiting.is_finished and engine.load() == (0, 0)


def test_a_reply_waiting_for_a_lab_run_says_so(tiny):
    """The engine names a call while it runs (Engine.calling), and a chat's waiting reply says what holds it."""
    from app.ui.chat_tab import _phase

    engine = Engine(tiny)
    assert "lab" == engine.call(lambda: engine.calling, name="lab") and engine.calling is None
    request = engine.new_request_from_ids([5, 6, 7])
    assert "the Lab is measuring" in engine.call(lambda: _phase(engine, None, request, "en"), name="lab")
    assert "实验室正在测量" in engine.call(lambda: _phase(engine, None, request, "zh"), name="lab")
    assert "Starting" in _phase(engine, None, request, "en")


def test_a_reply_paused_between_two_tokens_by_a_lab_run_says_so_and_keeps_the_wait(tiny):
    """A run that starts while a reply decodes holds it between two tokens: its phase line says so, and the
    Finished event says how long it waited (held_ms), which the page says once the reply ends."""
    from app.ui.chat_tab import _phase

    engine = Engine(tiny)
    request = engine.new_request_from_ids([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    events = []
    engine.submit(request, [events.append])
    while request.status != Status.DECODING:
        engine.step()

    def measure(lang: str) -> str:
        time.sleep(0.2)
        return _phase(engine, None, request, lang)

    assert "Paused" in engine.call(lambda: measure("en"), name="lab")
    assert "已暂停" in engine.call(lambda: measure("zh"), name="lab")
    engine.call(lambda: time.sleep(0.2))  # a call without a name is no measurement's
    later = []

    def submit_midway() -> None:  # a reply sent while the run goes on waits from then, not from its start
        time.sleep(0.2)
        later.append(engine.new_request_from_ids([8, 9], SamplingParams(max_new_tokens=2)))
        engine.submit(later[0], [events.append])
        time.sleep(0.1)

    engine.call(submit_midway, name="lab")
    while not (request.is_finished and later[0].is_finished):
        engine.step()
    held = next(e for e in events if isinstance(e, Finished) and e.request_id == request.request_id).held_ms
    assert list(held) == ["lab"] and 700 <= held["lab"] < 5000
    assert 100 <= later[0].held_ms["lab"] < 250
    # where: the three runs came between the same two tokens, so the token after them carries the whole wait
    steps = [e for e in events if isinstance(e, DecodeStep) and e.request_id == request.request_id]
    waited = [s for s in steps if s.held_ms]
    assert len(waited) == 1 and waited[0].held_ms == pytest.approx(held["lab"])
    assert waited[0].held_ms <= waited[0].latency_ms
    later_steps = [e for e in events if isinstance(e, DecodeStep) and e.request_id == later[0].request_id]
    assert later_steps[0].held_ms == pytest.approx(later[0].held_ms["lab"])  # in its TTFT, the first token's
    assert "Paused" not in _phase(engine, None, request, "en")


def test_a_variant_shares_the_forward_and_brings_its_own_switches(tiny):
    engine = Engine(tiny, EngineConfig(attention="sdpa"))
    eager = engine.variant(attention="eager", prefix_caching=False)
    assert eager.runner is engine.runner and eager.pool is not engine.pool
    list(eager.run(eager.new_request_from_ids([5, 6, 7], None)))
    assert engine.runner.attention == "eager"
    list(engine.run(engine.new_request_from_ids([5, 6, 7], None)))
    assert engine.runner.attention == "sdpa"  # each step runs under its own engine's settings
    fp16 = engine.variant(precision="fp16")
    assert fp16.runner is not engine.runner and fp16.info.precision == "fp16"


@pytest.mark.parametrize("switches", [dict(kv_cache=False), dict(kv_window=32, kv_sinks=4),
                                      dict(speculative="prompt-lookup", split_kv=False, attention="eager")])
def test_experiments_start_from_the_default_switches_whatever_the_app_runs_with(tiny, switches):
    """An app started with --no-kv-cache (or a window, speculation...): the kv-cache experiment's "KV cache"
    side has one, and the speculative experiment starts under a window; the precision stays the engine's."""
    engine = Engine(tiny, EngineConfig(precision="fp32", **switches))
    result = lab.run(engine, "kv-cache", quick=True)
    with_cache, without = (row["lab.col.last_step_gflop"] for row in result.table)
    assert with_cache < without  # the last step's work: one token against the whole sequence
    assert lab.run(engine, "speculative", quick=True).experiment == "speculative"
    plain = lab.Lab(engine).variant(prefix_caching=False).config
    assert (plain.precision, plain.kv_window, plain.speculative, plain.split_kv) == ("fp32", None, None, True)


def test_lab_runs_are_a_table_of_the_history_database(tmp_path):
    store = Store.open(tmp_path / "h.db")
    run_id = store.add_lab_run("batching", {"quick": True}, {"cores": 2}, {"table": [{"requests": 1}]})
    again = Store.open(tmp_path / "h.db")
    assert again.lab_runs() == [{"id": run_id, "created_at": again.lab_runs()[0]["created_at"],
                                 "experiment": "batching"}]
    assert again.lab_run(run_id)["results"] == {"table": [{"requests": 1}]}


@pytest.mark.parametrize("name", ["kv-cache", "batching", "threads"])
def test_a_run_reads_in_each_language(tiny, name):
    """A run keeps its words as catalogue keys: its report and figure come out whole in English and in
    Chinese (no key or field left over), and the English is what the experiment says."""
    result = lab.run(Engine(tiny, EngineConfig()), name, quick=True)
    english, chinese = result.markdown("en"), result.markdown("zh")
    for text in (english, chinese):
        assert "lab." not in text and "{" not in text
    assert english.startswith(f"## {lab.words('en', result.title)}") and "shown: " in english
    assert re.search(r"[\u4e00-\u9fff]", chinese) and "已显示" in chinese
    if name == "kv-cache":  # a yes/no column in words, not Python's True
        assert "| yes |" in english and "| 是 |" in chinese and "True" not in english
    for lang in ("en", "zh"):
        figure = lab.figure(result, lang)
        assert len(figure.data) == len(result.series)
        assert all("lab." not in trace.name for trace in figure.data)
        assert "lab." not in json.dumps(result.in_language(lang).to_dict(), ensure_ascii=False)
    assert "; meanwhile other programs used " in english and "；其间其他程序占用 " in chinese
    settings = {lang: text.rsplit("\n", 1)[-1] for lang, text in (("en", english), ("zh", chinese))}
    assert "prompt tokens" in settings["en"] and "提示词元数" in settings["zh"]
    for line in settings.values():  # in words, not Python's: no snake_case names, lists, dicts or True
        assert not re.search(r"[_\[\]{}]|True", line), line
    again = lab.LabResult.from_dict(json.loads(json.dumps(result.to_dict())))  # as the database keeps it
    assert again.markdown("zh") == chinese


def test_settings_read_as_words_and_a_name_the_catalogue_lacks_as_it_was_kept():
    settings = {"contexts": [256, 1024], "native_step": True,
                "machine_read_gb_s": {"1 thread": 22.8, "2 threads": 30.4}, "chunks": [64, "whole"], "old_name": "fp32"}
    assert lab.settings_line("en", settings) == ("context lengths 256, 1,024 · native decode step yes · memory read "
                                                 "rate (GB/s) 1 thread 22.8, 2 threads 30.4 · prefill chunks 64, "
                                                 "whole · old name fp32")
    assert lab.settings_line("zh", settings) == ("上下文长度 256、1,024 · 原生解码步 是 · 内存读取速率（GB/s） 1 线程 "
                                                 "22.8、2 线程 30.4 · 预填充分块 64、整体 · old name fp32")


def test_a_run_stored_before_the_lab_spoke_chinese_reads_as_it_was():
    """Runs saved with English words in place of keys: shown as they were, in either language's frame."""
    old = lab.LabResult("batching", "Batching: aggregate throughput against each request's TPOT", "A poem.",
                        {"new_tokens": 24}, "TPOT per request (ms)", "aggregate decode tok/s",
                        [lab.Series("batching · aggregate decode", [7.5, 10.2], [133.0, 237.0])],
                        [{"requests": 1, "aggregate tok/s": 133.0}, {"requests": 2, "aggregate tok/s": 237.0}],
                        "One request decoded at 133 tok/s.", {"batching raises aggregate throughput": True},
                        timed=["batching raises aggregate throughput"])
    stored = lab.LabResult.from_dict(json.loads(json.dumps(old.to_dict())))
    assert stored.in_language("zh").to_dict() == old.to_dict()
    assert "| requests | aggregate tok/s |" in stored.markdown("zh")
    assert "- 已显示：batching raises aggregate throughput（计时）" in stored.markdown("zh")
    assert [trace.name for trace in lab.figure(stored, "zh").data] == ["batching · aggregate decode"]


def test_lines_stay_above_bars_counted_on_the_right_axis_and_log_axes_read_whole_numbers():
    """Plotly draws the overlaying axis's traces on top: the prefix cache's bars (tokens, right axis) would
    hide the TTFT lines, so they trade layers and each axis keeps its side and title; a log axis is
    labelled 1-2-5 in whole numbers, not Plotly's bare minor digits."""
    turns = lab.LabResult("prefix-cache", "TTFT of each turn", "A chat.", {}, "turn", "TTFT (ms)",
                          [lab.Series("no reuse · TTFT", [1, 2], [141.0, 82.4]),
                           lab.Series("prefix cache · cached tokens", [1, 2], [0, 104], kind="bar", axis="y2")],
                          [], "", {}, y2_label="prompt tokens from the cache")
    fig = lab.figure(turns)
    line, bars = fig.data
    assert (line.yaxis, bars.yaxis) == ("y2", "y")  # the line on the overlaying axis: drawn above the bars
    assert fig.layout.yaxis2.overlaying == "y" and fig.layout.yaxis2.side == "left"
    assert fig.layout.yaxis2.title.text == "TTFT (ms)" and fig.layout.yaxis.title.text == "prompt tokens from the cache"
    assert fig.layout.yaxis.side == "right" and bars.opacity < 1  # a background: the line may share its colour
    assert fig.layout.yaxis.tickmode == "auto"  # round ticks of its own, not synced to the left axis's grid

    roofline = lab.LabResult("roofline", "Roofline", "A step.", {}, "FLOP per byte", "GFLOP/s",
                             [lab.Series("decode · achieved", [0.5, 2.0], [14.5, 43.3], kind="markers")], [], "", {},
                             log_x=True, log_y=True)
    fig = lab.figure(roofline)
    assert (fig.data[0].yaxis, fig.layout.yaxis.type, fig.layout.xaxis.type) == ("y", "log", "log")
    assert {"0.5", "2", "5", "10", "20", "50", "100"} <= set(fig.layout.yaxis.ticktext)
    assert fig.layout.yaxis2.overlaying is None  # no right axis asked for
    assert fig.layout.xaxis.dtick is None and lab.figure(turns).layout.xaxis.dtick == 1  # turns count 1, 2, 3


def test_a_runs_files_are_written_at_their_click_and_one_that_cannot_be_is_said(tmp_path, monkeypatch):
    """Showing a run writes nothing (its 4.8 MB page was written at every run shown or language switch and
    kept until the app ended); its button writes the file, in the page's language. A full disk or an
    unwritable temporary folder: a one-line warning (it was a traceback and no result)."""
    from app.ui import lab_tab

    monkeypatch.setattr(lab_tab, "exports_folder", lambda: tmp_path)
    result = lab.LabResult("batching", "lab.batching.title", "A poem.", {"new_tokens": 24}, "lab.col.batch",
                           "lab.w.aggregate_tps", [lab.Series("lab.col.batch", [1, 2], [133.0, 237.0])],
                           [{"lab.col.batch": 1}], "A sentence.", {"lab.batching.tpot": True})
    status, plot, report, json_button, html_button, shown = lab_tab._show(result, 3, "en")
    assert "lab run #3" in status and plot.visible and report.startswith("## ") and shown == (result.to_dict(), 3)
    assert json_button.visible and html_button.visible and [] == list(tmp_path.iterdir())
    saved = lab_tab.write_export("json", shown, "zh")
    assert saved.name == "lab-3-batching-zh.json" and json.loads(saved.read_text("utf-8"))["title"].startswith("批处理")
    page = lab_tab.write_export("html", shown, "en")
    assert page.name == "lab-3-batching-en.html" and "Plotly.newPlot" in page.read_text("utf-8")
    assert '"showSendToCloud": false' in page.read_text("utf-8")  # no upload to Plotly Cloud from the page

    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setattr(lab_tab, "exports_folder", lambda: tmp_path / "a-file")
    with pytest.raises(OSError, match=r"Not a directory"):
        lab_tab.write_export("json", shown, "en")


def test_the_roofline_probe_survives_a_cut_short_cache_file_and_one_it_cannot_write(tmp_path, monkeypatch):
    """Its cache of this machine's peaks, cut short (a full disk, a killed process), failed every Roofline
    run after it until deleted by hand: it is measured again and written whole (beside, then in place)."""
    import torch

    from app.lab.profile import PROBE_FILE, probe

    monkeypatch.setenv("PHASESCOPE_CACHE", str(tmp_path))
    (tmp_path / PROBE_FILE).write_text('{"cpu|AMD')
    peaks = probe(torch.device("cpu"))
    assert peaks["peak_gflops"] > 0 and peaks["bandwidth_gbs"] > 0
    assert json.loads((tmp_path / PROBE_FILE).read_text()) == {peaks["key"]: peaks}
    assert probe(torch.device("cpu")) == peaks  # from the cache now
    monkeypatch.setenv("PHASESCOPE_CACHE", str(tmp_path / PROBE_FILE / "not-a-folder"))
    assert probe(torch.device("cpu"))["peak_gflops"] > 0  # measured, and the cache left unwritten


def test_threads_on_a_busy_machine_binds_them_for_its_bound_side_only_and_leaves_no_spinner(tiny):
    """The experiment's bound runs have the forward's threads on a CPU each, its free ones none, the tokens
    the same in all four; afterwards the program it kept busy on a core is gone and the threads are free
    again, as the engine's own switch has them."""
    from app.lab.threads import bound_threads

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: every thread is on one CPU already")
    engine = Engine(tiny, EngineConfig(precision="fp32"))
    before = bound_threads()
    result = lab.run(engine, "threads", quick=True)
    assert [row["lab.col.setting"] for row in result.table] == [
        "lab.set.idle_free", "lab.set.busy_free", "lab.set.busy_bound", "lab.set.idle_bound"]
    assert all(result.counted_effects.values()), result.table
    assert [row["lab.col.threads_bound"] > before for row in result.table] == [False, False, True, True]
    assert bound_threads() == before
    spinning = subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True).stdout
    assert not spinning.strip()


def test_threads_without_the_native_step_is_said_so(tiny, tmp_path):
    from engine.models.llama import LeanLlama

    blocker = tmp_path / "file-not-folder"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="decode runs PyTorch ops"):
        runner = LeanLlama(tiny.model, "int8", cache_dir=str(blocker))
    engine = Engine(tiny, EngineConfig(), runner=runner)
    assert lab.cannot_run(engine, "threads") == (
        "“Threads on a busy machine” needs the native decode step (C++, built at the first start on CPU), which "
        "tiny-llama runs without here.")
    assert lab.cannot_run(engine, "threads", "zh").startswith("「繁忙机器上的线程」需要原生解码步")
