"""Faults: the database turning read-only or full mid-session, a model that fails to load, SIGTERM during
generation, two processes writing one database file. The chat goes on, saying it is not saving; nothing
saved before is lost; the file stays sound."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from app.history.store import Store
from engine import Engine, SamplingParams
from tests.conftest import record, tiny_model
from tests.test_crash import signal_mid_reply

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_the_database_failing_mid_session_warns_and_keeps_what_was_saved(tmp_path, tokenizer, fault):
    tiny_engine = Engine(tiny_model(tokenizer, max_positions=4096))  # room for a message of pages of its own
    store = Store.open(tmp_path / "h.db")
    session, _, _ = record(tiny_engine, store, "A first turn, saved", SAMPLING)
    if fault == "read-only":
        store.db.execute("PRAGMA query_only = ON")  # as a file the process may no longer write
    else:
        pages = store.db.execute("PRAGMA page_count").fetchone()[0]
        store.db.execute(f"PRAGMA max_page_count = {pages}")  # as a full disk
    second = None
    try:
        session, events, hook = record(tiny_engine, store, "A second turn " + "long " * 2000, SAMPLING,
                                       session=session)
        second = events
    except Exception as exc:  # the recorder's own writes (the user's message) are refused first
        assert "readonly" in str(exc) or "full" in str(exc)
    if second is not None:  # the reply itself still ran to its end; the hook said it could not save
        assert second[-1].reason == "length" and hook.error and "could not be saved" in hook.error
    store.db.execute("PRAGMA query_only = OFF")
    again = Store.open(tmp_path / "h.db")
    first = again.messages(session.store_id)[:2]
    assert [m["status"] for m in first] == ["complete", "complete"] and first[1]["content"]
    with sqlite3.connect(tmp_path / "h.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_the_chat_tab_says_not_saving_and_goes_on(tmp_path, tiny_engine):
    """The hook's failure reaches the chat as a warning; the reply is complete anyway."""
    from app.history.recorder import make_recorder
    from app.ui.session import ChatSession
    from app.ui.trace import ReplyTrace

    store = Store.open(tmp_path / "h.db")
    recorder = make_recorder(store, lambda: tiny_engine.info)
    session = ChatSession()
    trace = ReplyTrace(turn=1)
    hook = recorder(session, [{"role": "user", "content": "Hi"}], SAMPLING, trace)
    store.db.execute("PRAGMA query_only = ON")
    events = list(tiny_engine.run(tiny_engine.new_request([{"role": "user", "content": "Hi"}], SAMPLING),
                                  hooks=[trace.add, hook]))
    assert events[-1].reason == "length" and trace.text
    assert session.warnings and "could not be saved" in session.warnings[0].lower() + hook.error


def test_a_damaged_database_is_one_line_that_names_it_and_says_what_saves_it(tmp_path, tiny_engine):
    """A file a disk damaged under its steps: what reads the damaged pages says so in one line, in the CLI and
    in the store's error the page shows, not as a traceback."""
    from app.history.store import StoreError

    path = tmp_path / "h.db"
    store = Store.open(path)
    for i in range(3):
        record(tiny_engine, store, f"turn {i}", SamplingParams(max_new_tokens=200, ignore_eos=True))
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    size = path.stat().st_size
    with path.open("r+b") as f:  # the steps were written last: the file's second half holds them
        f.seek(size // 2 // 4096 * 4096)
        f.write(b"\xff" * (size - f.tell()))
    store = Store.open(path, upgrade=False)
    with pytest.raises(StoreError, match=f"^cannot read the history database {path}: database disk image is "
                                         f"malformed \\(damaged: `sqlite3 {path} .recover > saved.sql` keeps"):
        store.count_steps()
    out = subprocess.run([sys.executable, "-m", "app.cli", "export", "--db", str(path), "--all", "--format", "json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert 2 == out.returncode and "Traceback" not in out.stderr and 1 == len(out.stderr.splitlines())
    assert out.stderr.startswith(f"phasescope: error: cannot read the history database {path}: database disk")


def test_a_model_that_fails_to_load_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    for command in (["generate", "--prompt", "hi"], ["ui", "--db", str(tmp_path / "h.db")]):
        out = subprocess.run([sys.executable, "-m", "app.cli", *command, "--model", str(bad)], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("phasescope: error:") and "Traceback" not in out.stderr


def test_sigterm_mid_reply_keeps_earlier_messages_and_is_repaired(tmp_path):
    path = tmp_path / "history.db"
    assert signal_mid_reply(path, signal.SIGTERM) == -signal.SIGTERM
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store = Store.open(path)  # the next start marks the partial reply
    second = store.messages(1)[3]
    assert (second["status"], second["finish_reason"]) == ("stopped", "interrupted") and second["content"]
    assert store.messages(1)[1]["status"] == "complete"


TWO_WRITERS = """
import sys
sys.path.insert(0, "tests")
from transformers import AutoTokenizer
from app.history.store import Store
from conftest import record, tiny_model
from engine import Engine, SamplingParams
from engine.models.loader import model_folder

engine = Engine(tiny_model(AutoTokenizer.from_pretrained(model_folder(None))))
store = Store.open(sys.argv[1])
for i in range(15):
    record(engine, store, f"{sys.argv[2]} turn {i}", SamplingParams(max_new_tokens=40, ignore_eos=True))
"""


def test_two_processes_on_one_database_file(tmp_path):
    path = tmp_path / "h.db"
    Store.open(path)  # created and migrated once
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores: no OpenMP teams spinning
    writers = [subprocess.Popen([sys.executable, "-c", TWO_WRITERS, str(path), name], cwd=ROOT, env=one_thread)
               for name in ("left", "right")]
    assert [w.wait(timeout=180) for w in writers] == [0, 0]
    store = Store.open(path)
    titles = sorted(s["title"] for s in store.sessions())
    assert titles == sorted(f"{name} turn {i}" for name in ("left", "right") for i in range(15))
    assert all(m["status"] == "complete" for s in store.sessions() for m in store.messages(s["id"]))
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
