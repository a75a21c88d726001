"""Exports parsed back and checked against the stored rows; the CLI's sessions and export."""
from __future__ import annotations

import csv
import io
import json
import re
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.history.export import CSV_COLUMNS, export_filename, render, to_csv, to_json, write_export, write_to
from app.history.store import Store, StoreError
from conftest import record, tiny_model
from engine import DecodeStep, Engine, EngineConfig, SamplingParams


@pytest.fixture
def filled(tiny, store) -> Store:
    engine = Engine(tiny)
    session, _, _ = record(engine, store, 'Quote "this", please')
    record(engine, store, "Second turn", session=session)
    record(engine, store, "Another chat")
    # a token text that needs quoting in CSV
    message_id = store.messages(1)[1]["id"]
    store.db.execute("UPDATE steps SET token_text = ? WHERE message_id = ? AND phase = 'decode' AND idx = 0",
                     ['a,"b"\nc', message_id])
    return store


def all_steps(store: Store) -> list[tuple[dict, dict, dict]]:
    return [(s, m, st) for s in reversed(store.sessions()) for m in store.messages(s["id"])
            for st in store.steps(m["id"])]


def test_a_reply_held_by_a_lab_run_keeps_the_wait_in_the_history_and_its_export(tokenizer, store):
    """A Lab run that holds the serving engine mid-reply: the wait its Finished event reports is stored with
    the reply, comes back with its events (Open in chat), goes into the JSON export, and the History tab's
    turn table marks it."""
    from app.history.recorder import message_events
    from app.ui.session import EngineThread

    thread = EngineThread().start()
    engine = thread.call(lambda: Engine(tiny_model(tokenizer), EngineConfig()))
    thread.serve(engine)
    lab = []

    def run_the_lab(event) -> None:  # on the engine's thread: the run waits for the step to end
        if isinstance(event, DecodeStep) and not lab:
            lab.append(threading.Thread(target=engine.call, args=(lambda: time.sleep(0.2),), kwargs={"name": "lab"}))
            lab[0].start()

    try:
        _, events, _ = record(engine, store, "Hi", SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True),
                              hooks=[run_the_lab])
    finally:
        lab[0].join(30)
        thread.stop()
    held = events[-1].held_ms
    assert list(held) == ["lab"] and 200 <= held["lab"] < 5000
    reply = next(m for m in store.messages(1) if m["role"] == "assistant")
    assert json.loads(reply["held_ms"]) == held
    restored = message_events(reply, store.steps(reply["id"]))
    assert restored[-1].held_ms == held
    # and where it fell: the token after the run, as the engine's events said, in each export too
    live = [e.held_ms for e in events if isinstance(e, DecodeStep)]
    assert [s.held_ms for s in restored if isinstance(s, DecodeStep)] == pytest.approx(live, abs=1e-6)
    assert sum(live) == pytest.approx(held["lab"]) and sum(1 for ms in live if ms) == 1
    waited = live.index(max(live))
    json_steps = [s for s in next(m for m in to_json(store)["sessions"][0]["messages"] if m["role"] == "assistant")
                  ["steps"] if s["phase"] == "decode"]
    assert json_steps[waited]["held_ms"] == pytest.approx(live[waited]) and json_steps[0]["held_ms"] is None
    trace = [e for e in json.loads(render(store, "trace"))["traceEvents"] if e.get("cat") == "held"]
    assert len(trace) == 1 and trace[0]["args"]["held_ms"] == pytest.approx(live[waited])
    exported = next(m for m in to_json(store)["sessions"][0]["messages"] if m["role"] == "assistant")
    assert exported["held_ms"] == held
    rows = list(csv.DictReader(io.StringIO(to_csv(store))))
    assert {json.loads(r["held_ms"])["lab"] for r in rows if r["message_id"] == str(reply["id"])} == {held["lab"]}
    step_held = [float(r["step_held_ms"] or 0) for r in rows
                 if r["message_id"] == str(reply["id"]) and r["phase"] == "decode"]
    assert step_held == pytest.approx(live, abs=1e-6)
    assert all(m["held_ms"] is None for m in exported_messages(store) if m["id"] != reply["id"])
    from app.ui.history_tab import turns_table  # the History tab's turn by turn

    table = turns_table(exported_messages(store), "en")
    assert f"waited {held['lab'] / 1000:,.1f} s</span>" in table and "while a Lab run" in table


def exported_messages(store: Store) -> list[dict]:
    return [m for session in to_json(store)["sessions"] for m in session["messages"]]


def test_csv_has_one_row_per_step(filled):
    rows = list(csv.DictReader(io.StringIO(to_csv(filled))))
    expected = all_steps(filled)
    assert len(expected) == len(rows) and len(rows) > 20
    assert CSV_COLUMNS == list(rows[0])
    for row, (session, message, step) in zip(rows, expected):
        assert (str(session["id"]), str(message["id"]), step["phase"], str(step["idx"])) == (
            row["session_id"], row["message_id"], row["phase"], row["index"])
        assert float(row["latency_ms"]) == pytest.approx(step["latency_ns"] / 1e6)
        assert (str(step["kv_bytes"]), step["token_text"] or "") == (row["kv_bytes"], row["token_text"])
    assert 'a,"b"\nc' in [r["token_text"] for r in rows]


def test_csv_of_one_session(filled):
    rows = list(csv.DictReader(io.StringIO(to_csv(filled, 2))))
    assert {"2"} == {r["session_id"] for r in rows}


def test_json_nests_sessions_messages_steps_with_metrics(filled):
    data = json.loads(render(filled, "json"))
    assert ("phasescope-export", [1, 2]) == (data["format"], [s["id"] for s in data["sessions"]])
    first = data["sessions"][0]
    assert [m["id"] for m in filled.messages(1)] == [m["id"] for m in first["messages"]]
    reply = first["messages"][1]
    stored = filled.steps(reply["id"])
    assert [(s["phase"], s["idx"], s["kv_bytes"]) for s in stored] == [(s["phase"], s["idx"], s["kv_bytes"])
                                                                       for s in reply["steps"]]
    metrics = reply["metrics"]
    assert metrics["ttft_ms"] == pytest.approx(filled.messages(1)[1]["ttft_ms"])
    assert metrics["tpot_ms"] == pytest.approx(filled.messages(1)[1]["tpot_ms"])
    assert {"p50", "p90", "p99"} == set(metrics["itl_ms"])
    assert metrics["prefill_tokens_per_s"] > 0 and metrics["decode_tokens_per_s"] > 0
    assert "ttft_ms" in data["definitions"]
    assert first["messages"][0]["metrics"] is None  # the user's message
    assert 2 == first["summary"]["replies"] and {"p50", "p90", "p99"} == set(first["summary"]["ttft_ms"])
    assert first["summary"]["ttft_ms"]["p50"] <= first["summary"]["ttft_ms"]["p99"]


def test_trace_follows_the_trace_event_format(filled):
    data = json.loads(render(filled, "trace"))
    events = data["traceEvents"]
    for event in events:
        assert {"name", "ph", "pid"} <= set(event), event
        assert event["ph"] in ("X", "C", "M")
        if event["ph"] == "X":
            assert {"ts", "dur", "tid"} <= set(event) and event["dur"] >= 0
        if event["ph"] == "C":
            assert isinstance(event["args"]["kv_bytes"], int) and "ts" in event
    complete = [e for e in events if e["ph"] == "X"]
    assert len(all_steps(filled)) == len(complete)
    assert {"prefill", "decode"} == {e["cat"] for e in complete}
    assert len(complete) == len([e for e in events if e["ph"] == "C"])
    tracks = {(e["pid"], e["tid"]) for e in complete}
    assert len(tracks) == 3  # one track per assistant message
    for track in tracks:  # on each track: prefill chunks, then decode steps, in time order, not overlapping
        steps = [e for e in complete if (e["pid"], e["tid"]) == track]
        assert steps[0]["cat"] == "prefill" and steps[-1]["cat"] == "decode"
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(steps, steps[1:]))


@pytest.mark.parametrize("fmt", ["csv", "json", "trace"])
def test_an_export_reads_a_session_at_a_time_as_it_writes_them(filled, monkeypatch, fmt):
    """An export of every session holds one session's steps in memory, not all (the JSON of 1.2 M steps built
    whole took 4.9 GB): the first session is written before the second is read. One deleted meanwhile is
    left out, and the file is the one a single read makes."""
    whole = json.loads(render(filled, "json")) if fmt == "json" else None
    read, seen = [], []
    real_messages = filled.messages

    def messages(session_id):
        read.append(session_id)
        return real_messages(session_id)

    class Out(io.StringIO):
        def write(self, text):
            seen.append(len(read))
            return super().write(text)

    monkeypatch.setattr(filled, "messages", messages)
    out = Out()
    write_to(out, filled, fmt)
    assert 1 in seen and [1, 2] == read
    if fmt == "json":  # the text written a session at a time is the whole export's
        assert whole == json.loads(out.getvalue())
        assert all(len(line) < 400 for line in out.getvalue().splitlines())  # a step a line, not 17
    read.clear()
    monkeypatch.setattr(filled, "messages", lambda session_id: (filled.delete_session(2), real_messages(session_id),
                                                                read.append(session_id))[1])
    exported = render(filled, fmt)
    assert [1] == read and (fmt != "json" or [1] == [s["id"] for s in json.loads(exported)["sessions"]])


def test_export_file_names_carry_no_user_text():
    assert "phasescope-session-3.csv" == export_filename("csv", 3)
    assert "phasescope-all-sessions.trace.json" == export_filename("trace", None)


def test_write_refuses_to_overwrite_without_force(filled, tmp_path):
    path = tmp_path / "out.csv"
    path.write_text("keep me")
    with pytest.raises(FileExistsError, match="pass --force"):
        write_export(filled, "csv", path)
    assert "keep me" == path.read_text()
    write_export(filled, "csv", path, force=True)
    assert path.read_text().startswith("session_id,")
    # a folder: the file goes in it, named as the History tab names it (and is not replaced without force)
    assert tmp_path / "phasescope-all-sessions.csv" == write_export(filled, "csv", tmp_path)
    with pytest.raises(FileExistsError, match="phasescope-all-sessions.csv exists; pass --force"):
        write_export(filled, "csv", tmp_path)


def test_a_full_disk_leaves_the_file_it_would_replace(filled, tmp_path, monkeypatch):
    import errno

    path = tmp_path / "out.csv"
    path.write_text("keep me")
    real_open = Path.open

    class FullDisk:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, text):
            self.file.write(text[:10])  # a part was written, then the disk was full
            raise OSError(errno.ENOSPC, "No space left on device", self.file.name)

    monkeypatch.setattr(Path, "open", lambda self, *args, **kwargs: FullDisk(real_open(self, *args, **kwargs)))
    with pytest.raises(OSError, match="No space left"):
        write_export(filled, "csv", path, force=True)
    monkeypatch.undo()
    assert "keep me" == path.read_text() and ["out.csv"] == [p.name for p in tmp_path.iterdir()]


def test_two_pages_exporting_the_same_file_at_once_each_get_a_whole_one(filled, tmp_path, monkeypatch):
    """The History tab writes each file under one name (any page's click, under `serve --ui` any user's): two
    exports at once shared the scratch file beside it, the second writing into the first's, which then failed."""
    real_messages, paused, go_on, done = filled.messages, threading.Event(), threading.Event(), {}

    def messages(session_id):  # the first export waits, its file begun, while the second is written whole
        if threading.current_thread().name == "first" and not paused.is_set():
            paused.set()
            go_on.wait(10)
        return real_messages(session_id)

    def export(name):
        try:
            done[name] = write_export(filled, "json", tmp_path, force=True)
        except OSError as exc:
            done[name] = exc

    monkeypatch.setattr(filled, "messages", messages)
    first = threading.Thread(target=export, args=("first",), name="first")
    first.start()
    assert paused.wait(10)
    export("second")
    go_on.set()
    first.join(10)
    path = tmp_path / export_filename("json", None)
    assert done == {"first": path, "second": path}
    assert json.loads(render(filled, "json")) == json.loads(path.read_text(encoding="utf-8"))
    assert [path] == list(tmp_path.iterdir())  # no scratch file left


def test_a_sessions_percentiles_are_those_of_its_replies(filled):
    from app.history.recorder import message_metrics
    from app.ui.history_tab import percentile_table
    from engine.metrics import percentile

    replies = [message_metrics(m, filled.steps(m["id"])) for m in filled.messages(1) if m["role"] == "assistant"]
    data = to_json(filled, 1)  # what the History tab shows
    summary = dict(data["sessions"][0]["summary"])
    count = summary.pop("replies")
    assert 2 == count == len(replies) and list(summary) == ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"]
    assert summary["ttft_ms"]["p50"] == percentile([m.ttft_ms for m in replies], 50)
    assert summary["itl_ms"]["p99"] == percentile([v for m in replies for v in m.itl_ms], 99)
    html = percentile_table(data["sessions"][0]["summary"], "zh")
    assert "本会话 2 条回复" in html and html.count("<tr>") == 5  # a header and TTFT, TPOT, ITL, E2E
    from app.ui.history_tab import engines_line  # how the engine ran them, as each reply was saved

    messages = data["sessions"][0]["messages"]
    precision = messages[1]["engine"]["precision"]
    assert f"Run in: {precision} (2)" in engines_line(messages, "en")
    messages[3]["engine"] = {"precision": "int8", "kv_window": 256, "kv_sinks": 8}
    assert f"{precision} (1), int8 --kv-window 256 --kv-sinks 8 (1)" in engines_line(messages, "en")
    assert "" == engines_line([{**m, "engine": None} for m in messages], "en")  # saved before schema 8


def test_a_sessions_turns_show_each_kept_message_and_its_reply(tiny, store):
    """History's turn by turn: the message and reply each turn kept, with the reply's figures; a message
    edited and a reply retried are left out and counted."""
    from app.history.export import to_json
    from app.ui.history_tab import turns_table

    engine = Engine(tiny)
    session, _, _ = record(engine, store, "First <b>question</b>, long enough to be cut short in its row")
    record(engine, store, "Second question", session=session)
    session.cut(1)  # the second message edited
    record(engine, store, "Second question, edited", session=session)
    messages = to_json(store, session.store_id)["sessions"][0]["messages"]
    html = turns_table(messages, "en")
    replies = [m for m in messages if m["role"] == "assistant" and m["replaced_by"] is None]
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr><td>.*?</tr>", html)]
    assert [["1", "2"], ["6", "6"]] == [[c[0] for c in cells], [c[-1] for c in cells]]  # the kept turns
    assert 'title="First &lt;b&gt;question&lt;/b&gt;, long enough to be cut short in its row">' in cells[0][1]
    assert ">First &lt;b&gt;question&lt;/b&gt;, long enough to be cut sh…<" in cells[0][1]  # 48 characters
    assert ">Second question, edited<" in cells[1][1]
    m = replies[1]["metrics"]
    assert f"{m['num_prompt_tokens']} ({m['num_cached_tokens']})" == cells[1][2] and m["num_cached_tokens"] > 0
    assert f"{m['ttft_ms']:,.1f}" == cells[1][3]
    assert "1 reply that a Retry or an edit replaced is left out here." in html
    assert "逐轮" in turns_table(messages, "zh") and "" == turns_table(messages[:1], "en")


def test_unknown_session_is_an_error(filled, tmp_path):
    with pytest.raises(StoreError, match="no session with id 99"):
        write_export(filled, "json", tmp_path / "x.json", session_id=99)
    assert not (tmp_path / "x.json").exists()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_sessions_and_export(tiny, tmp_path):
    path = tmp_path / "h.db"
    store = Store.open(path)
    engine = Engine(tiny)
    record(engine, store, "CLI question")
    listing = cli("sessions", "--db", str(path))
    assert 0 == listing.returncode and "CLI question" in listing.stdout and "tiny-llama" in listing.stdout
    assert re.search(rf"run in .*\n.* {engine.info.precision} +tiny-llama", listing.stdout)  # its replies' precision
    store.create_session("Remote", "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "endpoint http://h/v1", "", {})
    listing = cli("sessions", "--db", str(path))  # a model named by its file's path (llama-server's): its name
    assert re.search(r" SmolLM2-135M-Instruct\.Q4  Remote\n", listing.stdout), listing.stdout
    out = tmp_path / "s.json"
    assert 0 == cli("export", "--db", str(path), "--session", "1", "--format", "json", "-o", str(out)).returncode
    assert "CLI question" == json.loads(out.read_text())["sessions"][0]["title"]
    again = cli("export", "--db", str(path), "--session", "1", "--format", "json", "-o", str(out))
    assert (2, True) == (again.returncode, "pass --force" in again.stderr)
    stdout = cli("export", "--db", str(path), "--all", "--format", "csv")
    assert stdout.stdout.startswith("session_id,message_id")


@pytest.mark.parametrize("db_is, args, message", [
    ("empty", ["export", "--session", "42", "--format", "csv"], "no session with id 42"),
    ("not sqlite", ["sessions"], "is not a SQLite database"),
    ("missing", ["sessions"], "no history database at"),
    ("missing", ["export", "--all", "--format", "csv"], "no history database at"),
    ("missing", ["chat", "--session", "1"], "no history database at"),
])
def test_cli_store_errors_exit_2(tmp_path, db_is, args, message):
    db = tmp_path / "h.db"
    if db_is == "empty":
        Store.open(db).close()
    if db_is == "not sqlite":
        db.write_text("not a database")
    result = cli(*args, "--db", str(db))
    assert 2 == result.returncode and message in result.stderr
    assert 1 == len(result.stderr.strip().splitlines())
    assert db.exists() == (db_is != "missing")  # a command that reads the history leaves no empty one behind


def test_the_apps_export_folder_goes_when_the_process_exits():
    code = ("from app.ui.history_tab import export_folder; folder = export_folder(); "
            "(folder / 'session-1.json').write_text('{}'); print(folder)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    folder = done.stdout.strip()
    assert folder and not os.path.exists(folder)


def test_cli_says_which_file_it_cannot_write(tmp_path):
    out = tmp_path / "no folder" / "s.csv"
    Store.open(tmp_path / "h.db").close()
    result = cli("export", "--db", str(tmp_path / "h.db"), "--all", "--format", "csv", "-o", str(out))
    assert 2 == result.returncode
    assert f"phasescope: error: {out}: no such file or directory" == result.stderr.strip()
