"""A process killed with SIGKILL mid-reply leaves a sound database, and the next start repairs it."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

from app.history.store import Store

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, "tests")
    from transformers import AutoTokenizer
    from app.history.store import Store
    from conftest import record, tiny_model
    from engine import DecodeStep, Engine, SamplingParams
    from engine.models.loader import model_folder

    tokenizer = AutoTokenizer.from_pretrained(model_folder(None))
    engine = Engine(tiny_model(tokenizer, max_positions=4096))
    store = Store.open(sys.argv[1])
    session, _, _ = record(engine, store, "A first, finished turn")
    print("FIRST DONE", flush=True)

    def slow(event):
        if isinstance(event, DecodeStep):
            time.sleep(0.005)
            print("STEP", event.step, flush=True)

    record(engine, store, "A long second turn", SamplingParams(max_new_tokens=3000, ignore_eos=True),
           session=session, hooks=[slow])
    print("SHOULD NOT FINISH", flush=True)
""")


def signal_mid_reply(path: Path, signum: int) -> int:
    """Run CHILD on the database at path, send it signum 100 decode steps into its second turn; its exit
    status."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for line in child.stdout:
            if line.startswith("STEP") and int(line.split()[1]) >= 100:
                child.send_signal(signum)
                break
        return child.wait(timeout=60)
    finally:
        child.kill()


def test_sigkill_mid_reply_keeps_earlier_messages_and_is_repaired(tmp_path):
    path = tmp_path / "history.db"
    assert -signal.SIGKILL == signal_mid_reply(path, signal.SIGKILL)

    conn = sqlite3.connect(path)
    assert [("ok",)] == conn.execute("PRAGMA integrity_check").fetchall()
    rows = conn.execute("SELECT turn, role, status FROM messages ORDER BY id").fetchall()
    assert [(1, "user", "complete"), (1, "assistant", "complete"), (2, "user", "complete"),
            (2, "assistant", "in_progress")] == rows
    conn.close()

    store = Store.open(path)  # the next start
    first, second = store.messages(1)[1], store.messages(1)[3]
    assert ("complete", 6) == (first["status"], len(store.steps(first["id"])) - 1)
    assert ("stopped", "interrupted") == (second["status"], second["finish_reason"])
    kept = store.steps(second["id"])
    assert len(kept) >= 64  # whole batches written before the kill survive it
    assert [s["idx"] for s in kept if s["phase"] == "decode"] == list(range(len(kept) - 1))
    assert second["content"]  # the partial text was saved with the batches
