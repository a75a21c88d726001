"""The history database: round trip, batched writes, Stop and errors, migrations, bad files."""
from __future__ import annotations

import csv
import html
import io
import json
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.history.recorder import BATCH_STEPS, load_chat, message_events
from app.history.store import LATEST_VERSION, MIGRATIONS, Store, StoreError
from conftest import record
from engine import DecodeStep, Engine, EngineConfig, Finished, PrefillChunk, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def comparable(events) -> list[tuple]:
    out = []
    for e in events:
        if isinstance(e, PrefillChunk):
            out.append(("prefill", e.chunk_index, e.start, e.end, e.kv_tokens, e.kv_bytes, round(e.latency_ms, 6),
                        round(e.t_ms, 6)))
        elif isinstance(e, DecodeStep):
            out.append(("decode", e.step, e.token_id, e.text, e.kv_tokens, e.kv_bytes, round(e.latency_ms, 6),
                        round(e.t_ms, 6), round(e.prob, 6)))
    return out


def test_round_trip_keeps_every_step(tiny, store):
    engine = Engine(tiny)
    session, events, _ = record(engine, store, "Hello there")
    [user, assistant] = store.messages(session.store_id)
    assert ("user", "Hello there", "assistant", "complete", "length") == (
        user["role"], user["content"], assistant["role"], assistant["status"], assistant["finish_reason"])
    finished = events[-1]
    assert (finished.text, 6, finished.metrics.ttft_ms) == (
        assistant["content"], assistant["generated_tokens"], assistant["ttft_ms"])
    restored = message_events(assistant, store.steps(assistant["id"]))
    assert comparable(events) == comparable(restored)
    assert restored[-1].metrics.tpot_ms == pytest.approx(finished.metrics.tpot_ms)


def test_a_chat_goes_on_past_the_context_window_and_the_history_keeps_every_turn(tiny, store):
    engine = Engine(tiny)  # a 256-token context window
    session, cached, warned = None, [], []
    for turn in range(14):
        session, events, _ = record(engine, store, f"Question {turn}: " + "word " * 20, session=session)
        cached.append(events[0].num_cached_tokens)
        warned.append(bool(session.warnings))
        session.warnings.clear()
    drops = [turn for turn, said in enumerate(warned) if said]
    assert drops and drops[0] >= 4 and all(b - a > 1 for a, b in zip(drops, drops[1:]))  # not every turn
    assert session.left_out > 0 and session.left_out % 2 == 0  # whole exchanges
    for turn in range(drops[0] + 1, 14):  # each turn's prompt starts as the last one's did: the prefix cache finds it
        if turn not in drops:
            assert cached[turn] > 0, (turn, cached)
    messages = store.messages(session.store_id)
    assert [f"Question {turn}:" for turn in range(14)] == [m["content"].split(" word")[0] for m in messages[::2]]
    session.cut(1)  # an edit of the second message: back before the part left out, which may all fit again
    assert session.left_out == 0 and len(session.messages) == 2


def test_steps_are_written_while_generating(tiny, store, monkeypatch):
    # batches by count alone: on a busy machine slow steps also write by age, and the batch seen is not whole
    monkeypatch.setattr("app.history.recorder.BATCH_SECONDS", 1e9)
    engine = Engine(tiny)
    seen_in_db = []

    def look(event):
        if isinstance(event, DecodeStep) and event.step == BATCH_STEPS + 5:
            message = store.messages(1)[-1]
            seen_in_db.append((message["status"], len(store.steps(message["id"]))))

    record(engine, store, sampling=SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True), hooks=[look])
    status, count = seen_in_db[0]
    assert "in_progress" == status
    assert BATCH_STEPS <= count < BATCH_STEPS + 7  # a batch was written, the rest was still pending


def test_stop_keeps_the_partial_reply_and_its_steps(tiny, store):
    engine = Engine(tiny)
    holder = {}

    def cancel_at_5(event):
        if isinstance(event, DecodeStep) and event.step == 5:
            holder["request"].cancel()

    original_new_request = engine.new_request
    engine.new_request = lambda *a, **k: holder.setdefault("request", original_new_request(*a, **k))
    session, events, _ = record(engine, store, sampling=SamplingParams(max_new_tokens=50, ignore_eos=True),
                                hooks=[cancel_at_5])
    message = store.messages(session.store_id)[-1]
    assert ("stopped", "cancelled", events[-1].text) == (message["status"], message["finish_reason"],
                                                         message["content"])
    assert [("prefill", 0)] + [("decode", i) for i in range(6)] == [(s["phase"], s["idx"]) for s in
                                                                     store.steps(message["id"])]


def test_a_failed_reply_is_stored_as_error(tiny, store, monkeypatch):
    engine = Engine(tiny)
    monkeypatch.setattr(engine.runner, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    session, _, _ = record(engine, store)
    message = store.messages(session.store_id)[-1]
    assert ("error", "RuntimeError: boom") == (message["status"], message["error"])


def test_a_reply_that_fails_part_way_shows_its_text_then_why(tiny, store, monkeypatch):
    """A reply that ends in an error after some text (a remote server gone mid-stream, a failed step): the chat
    shows that text with the error under it, as the history keeps it, and again when reopened."""
    engine = Engine(tiny)
    decode, steps = engine.decode_step, []

    def fails_at_the_fourth(*args, **kwargs):
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("boom")
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, "decode_step", fails_at_the_fourth)
    session, events, _ = record(engine, store)
    assert "error" == events[-1].reason and events[-1].text.strip()
    shown = session.display[-1]["content"]
    assert shown.endswith("\n\n⚠️ RuntimeError: boom") and len(shown) > len("\n\n⚠️ RuntimeError: boom")
    assert events[-1].text == store.messages(session.store_id)[-1]["content"]
    assert shown == load_chat(store, session.store_id).display[-1]["content"]


def test_a_broken_database_does_not_stop_the_reply(tiny, store):
    engine = Engine(tiny)
    session, events, hook = record(engine, store)

    def fail_writes_mid_reply(event):  # like a disk that fills up while the reply streams
        if isinstance(event, DecodeStep) and event.step == 1:
            store.db.execute("PRAGMA query_only = ON")

    _, events, hook = record(engine, store, session=session, hooks=[fail_writes_mid_reply])
    store.db.execute("PRAGMA query_only = OFF")
    assert "length" == events[-1].reason  # generation went on
    assert "could not be saved" in hook.error and "readonly" in hook.error
    assert session.warnings == [hook.error]
    assert 2 == len(store.messages(session.store_id)) // 2  # both turns' rows, the first one complete
    assert "complete" == store.messages(session.store_id)[1]["status"]


def test_second_turn_goes_to_the_same_session_and_restores(tiny, store):
    engine = Engine(tiny)
    session, _, _ = record(engine, store, "First question")
    record(engine, store, "Second question", session=session)
    restored = load_chat(store, session.store_id)
    assert session.messages == restored.messages
    assert [1, 2] == [t.turn for t in restored.traces]
    assert ["First question", "Second question"] == [d["content"] for d in restored.display if d["role"] == "user"]
    assert all("prompt tok · cached " in d["content"] for d in restored.display if d["role"] == "assistant")


def test_each_reply_saves_what_it_was_asked_with_and_a_chat_opened_again_goes_on_with_it(tiny, store):
    """A chat opened again (History, a reload) went on with the Settings as they were in the page: without its
    system prompt, the start of every prompt, the prefix cache missed and the model saw another conversation."""
    import gradio as gr

    from app.history.export import to_json
    from app.ui.chat_tab import settings_shown
    from app.ui.history_tab import asked_line

    engine = Engine(tiny)
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, seed=7)
    session, _, _ = record(engine, store, "First question", sampling=greedy, system="Answer in French.")
    session.settings = {"prefill_chunk": 64}  # as the chat tab's accept keeps them
    warmer = SamplingParams(max_new_tokens=5, temperature=0.5, top_p=0.9, ignore_eos=True)
    record(engine, store, "Second question", session=session, sampling=warmer, system="Answer in French.")
    first, second = [json.loads(m["settings"]) for m in store.messages(session.store_id) if m["role"] == "assistant"]
    assert ("Answer in French.", 0, 7, None) == (first["system"], first["temperature"], first["seed"],
                                                first.get("prefill_chunk"))
    assert ("Answer in French.", 0.5, 0.9, 64) == (second["system"], second["temperature"], second["top_p"],
                                                  second["prefill_chunk"])
    restored = load_chat(store, session.store_id)
    assert second == restored.settings  # the last reply's
    assert ["Answer in French.", 5, 0.5, 0.9, 0, 1.0, -1, 64] == settings_shown(restored.settings)  # SETTINGS' order
    exported = to_json(store, session.store_id)["sessions"][0]
    assert [None, first, None, second] == [m["settings"] for m in exported["messages"]]
    assert 0 == exported["settings"]["temperature"]  # the session's: its first reply's sampling
    assert ("Asked with: system prompt “Answer in French.” · temperature 0 · seed 7 · up to 4 new tokens (1); "
            "system prompt “Answer in French.” · temperature 0.5 · top-p 0.9 · up to 5 new tokens · prefill chunks "
            "of 64 (1)") == html.unescape(re.sub("<[^>]+>", "", asked_line(exported["messages"], "en")))
    store.db.execute("UPDATE messages SET settings = NULL")  # replies saved before they were
    assert {} == load_chat(store, session.store_id).settings
    assert all(value == gr.skip() for value in settings_shown({}))


def test_a_retried_reply_takes_the_turn_and_the_replaced_one_stays_in_the_history(tiny, store):
    from app.history.export import to_csv, to_json

    engine = Engine(tiny)
    session, _, _ = record(engine, store, "First question")
    record(engine, store, "Second question", session=session)
    session.asked = "Second question"  # as the chat tab's accept keeps it
    assert "Second question" == session.retract()
    assert (2, 1) == (len(session.messages), len(session.traces))  # the first turn is left
    shorter = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    _, events, _ = record(engine, store, "Second question", session=session, sampling=shorter)
    assert events[0].num_cached_tokens > 0  # the same prompt again: prefilled from the cache
    rows = store.messages(session.store_id)
    assert [(1, "user"), (1, "assistant"), (2, "user"), (2, "assistant"), (2, "assistant")] == [
        (m["turn"], m["role"]) for m in rows]
    replaced, retried = rows[3], rows[4]
    assert (retried["id"], None) == (replaced["replaced_by"], retried["replaced_by"])
    assert (6, 4) == (replaced["generated_tokens"], retried["generated_tokens"])
    restored = load_chat(store, session.store_id)
    assert session.messages == restored.messages  # the retried reply, not the one it replaced
    assert ([1, 2], 4) == ([t.turn for t in restored.traces], len(restored.traces[1].steps))
    assert 2 == store.sessions()[0]["turns"]
    exported = to_json(store, session.store_id)["sessions"][0]["messages"]  # both replies' timings, measured
    assert [None, None, None, retried["id"], None] == [m["replaced_by"] for m in exported]
    assert [None] * 5 == [m["writer"] for m in rows] and not any("writer" in m for m in exported)  # ended
    assert 6 == len([s for s in exported[3]["steps"] if s["phase"] == "decode"])
    replaced_rows = [row for row in csv.DictReader(io.StringIO(to_csv(store, session.store_id)))
                     if row["replaced_by"]]
    assert 1 + 6 == len(replaced_rows) and {str(retried["id"])} == {row["replaced_by"] for row in replaced_rows}


def test_cut_takes_back_answered_failed_and_refused_exchanges():
    """An edit goes back over every kind of exchange: answered (in the conversation), failed (shown, not in
    it) and refused by the engine before it ran (no reply at all)."""
    from app.ui.session import ChatSession
    from app.ui.trace import ReplyTrace

    session = ChatSession()
    for text, outcome in (("one", "answered"), ("two", "refused"), ("three", "failed"), ("four", "answered")):
        session.accept(text)
        session.pending = ""
        if outcome == "refused":
            session.show_error("the queue is full")
            continue
        trace = ReplyTrace(turn=len(session.traces) + 1)
        if outcome == "failed":
            trace.add(Finished("r", 1.0, "error", "", None, "the forward failed"))
        session.traces.append(trace)
        if outcome == "answered":
            session.converse(text, trace)
        session.show_reply(trace)
    session.cut(2)  # "three" edited: "three" and "four" leave
    assert (4, 2, 1, {1}) == (len(session.display), len(session.messages), len(session.traces), session.refused)
    session.cut(1)  # "two" edited: the refused one leaves, nothing else had entered the chat with it
    assert (2, 2, 1, set()) == (len(session.display), len(session.messages), len(session.traces), session.refused)
    session.cut(0)
    assert ([], [], []) == (session.display, session.messages, session.traces)


def test_an_edited_message_takes_its_turn_and_what_it_replaced_stays_in_the_history(tiny, store):
    """Editing the second of three messages: the chat goes back to before it and sends the new text; the
    history shows the chat as it goes on, and keeps the message, replies and turn it replaced, marked."""
    from app.history.export import to_json

    engine = Engine(tiny)
    session, _, _ = record(engine, store, "First question")
    for text in ("Second question", "Third question"):
        record(engine, store, text, session=session)
    session.cut(1)  # the second message edited: it and the third leave the chat
    assert (2, 1, 2) == (len(session.messages), len(session.traces), len(session.display))
    _, events, _ = record(engine, store, "Second question, edited", session=session)
    assert events[0].num_cached_tokens > 0  # the first turn came from the prefix cache
    rows = store.messages(session.store_id)
    edited_reply = max(m["id"] for m in rows)
    assert [(1, "user", None), (1, "assistant", None),  # in turn order
            (2, "user", edited_reply), (2, "assistant", edited_reply), (2, "user", None), (2, "assistant", None),
            (3, "user", edited_reply), (3, "assistant", edited_reply)] == [
        (m["turn"], m["role"], m["replaced_by"]) for m in rows]
    restored = load_chat(store, session.store_id)
    assert session.messages == restored.messages and "Second question, edited" == restored.messages[2]["content"]
    assert [1, 2] == [t.turn for t in restored.traces] and 2 == store.sessions()[0]["turns"]
    record(engine, store, "A new third question", session=session)  # turn 3 again, after the replaced one
    restored = load_chat(store, session.store_id)
    assert ["First question", "Second question, edited", "A new third question"] == [
        m["content"] for m in restored.messages[::2]]
    assert session.messages == restored.messages
    exported = to_json(store, session.store_id)["sessions"][0]["messages"]
    assert 10 == len(exported) and 4 == sum(m["replaced_by"] is not None for m in exported)  # nothing lost


def test_a_session_continued_in_two_tabs_goes_on_in_a_copy_for_the_second(tiny, store):
    """Tab one chats on in a session that tab two opened from History: tab two's next turn, or its Retry,
    must not take tab one's turn as its own (a retry marking tab one's reply replaced, its message lost)."""
    engine = Engine(tiny)
    one, _, _ = record(engine, store, "Question 1")
    record(engine, store, "Question 2", session=one)
    for retry in (False, True):
        two = load_chat(store, one.store_id)  # History: Open in chat
        record(engine, store, "Tab one's next question", session=one)
        if retry:  # of the last turn tab two has
            two.asked = two.messages[-2]["content"]
            two.retract()
        record(engine, store, "Tab two's question", session=two)
        turns = len(two.traces)
        assert [f"session {one.store_id} was continued meanwhile, in another tab or chat: this chat goes on as "
                f"session {two.store_id}, which starts with a copy of the turns before this one"] == two.warnings
        mine = store.messages(one.store_id)
        assert all(m["replaced_by"] is None for m in mine) and "Tab two's question" not in str(mine)
        copied = store.messages(two.store_id)
        assert [(m["turn"], m["role"], m["content"]) for m in mine[:2 * turns - 2]] == [
            (m["turn"], m["role"], m["content"]) for m in copied[:-2]]
        assert [len(store.steps(m["id"])) for m in mine[:2 * turns - 2]] == [  # the copies' steps too
            len(store.steps(m["id"])) for m in copied[:-2]]
        assert [(turns, "user"), (turns, "assistant")] == [(m["turn"], m["role"]) for m in copied[-2:]]
        assert "Tab two's question" == copied[-2]["content"]
        assert two.store_id != one.store_id and turns == store.sessions()[0]["turns"]
        record(engine, store, "Tab two goes on", session=two)  # in its own session now: no second copy
        assert 1 == len(two.warnings) and turns + 1 == store.sessions()[0]["turns"]


def test_cached_prompt_tokens_and_batch_sizes_are_stored_and_restored(tiny, store):
    from app.history.export import to_csv, to_json

    engine = Engine(tiny)
    session, _, _ = record(engine, store, "First question, long enough to fill a block or two of the cache")
    _, events, _ = record(engine, store, "Second question", session=session)
    cached = events[0].num_cached_tokens
    assert cached > 0  # the first turn's blocks were reused
    second = store.messages(session.store_id)[3]
    assert cached == second["cached_prompt_tokens"]
    steps = store.steps(second["id"])
    assert [1] * 6 == [s["batch_size"] for s in steps if s["phase"] == "decode"]
    restored = load_chat(store, session.store_id).traces[1]
    assert cached == restored.num_cached_tokens == restored.chunks[0].start  # the chart starts from the kept part
    header, *rows = to_csv(store, session.store_id).splitlines()
    assert header.endswith(",batch_size,cached_prompt_tokens,replaced_by,precision,switches,held_ms,step_held_ms")
    assert rows[-1].endswith(f",1,{cached},,{engine.info.precision},,,")  # no switches set, nothing held it
    exported = to_json(store, session.store_id)["sessions"][0]["messages"][3]
    assert (cached, 1) == (exported["metrics"]["num_cached_tokens"], exported["steps"][-1]["batch_size"])


def test_each_reply_keeps_how_the_engine_ran_it(tiny, store):
    """The weights' precision and the switches away from their defaults, per reply (a precision switch or
    another app's flags change them between turns): in the JSON export, so that int8 and fp32 replies, or
    replies without a KV cache, are told apart."""
    from app.history.export import to_json

    engine = Engine(tiny, EngineConfig(precision="fp32"))
    assert {} == engine.config.switches()
    session, _, _ = record(engine, store, "First")
    recomputing = engine.variant(kv_cache=False, speculative=None)
    _, events, _ = record(recomputing, store, "Second", session=session)
    assert {"precision": "fp32", "kv_cache": False} == events[0].engine  # the Started event says it
    messages = to_json(store, session.store_id)["sessions"][0]["messages"]
    assert [None, {"precision": "fp32"}, None, {"precision": "fp32", "kv_cache": False}] == [
        m["engine"] for m in messages]
    from app.history.export import to_csv

    last = list(csv.DictReader(to_csv(store, session.store_id).splitlines()))[-1]
    assert ["fp32", '{"kv_cache": false}', ""] == [last["precision"], last["switches"], last["held_ms"]]
    assert {"speculative": "prompt-lookup", "draft_tokens": 4} == EngineConfig(speculative="prompt-lookup",
                                                                               draft_tokens=4).switches()
    assert {"kv_window": 64} == EngineConfig(kv_window=64).switches()  # the sinks only when changed, with a window


def test_sessions_list_search_rename_delete(tiny, store):
    engine = Engine(tiny)
    first, _, _ = record(engine, store, "About penguins")
    second, _, _ = record(engine, store, "About elephants")
    assert [second.store_id, first.store_id] == [s["id"] for s in store.sessions()]  # newest first
    [row] = store.sessions("penguin")
    assert (first.store_id, "About penguins", 1) == (row["id"], row["title"], row["turns"])
    assert row["mean_ttft_ms"] > 0 and row["mean_tpot_ms"] > 0
    third, _, _ = record(engine, store, "A 50% discount on file_names")
    for text in ("50%", "%", "_", "file_n", "5_%", ""):  # the text itself, not LIKE's wildcards
        holding = [row["id"] for row in store.sessions() if text in row["title"]
                   or any(text in m["content"] for m in store.messages(row["id"]))]
        assert holding == [row["id"] for row in store.sessions(text)], text
        assert (third.store_id in holding) == (text != "5_%"), text
    store.delete_session(third.store_id)
    store.rename_session(first.store_id, "Birds")
    assert "Birds" == store.session(first.store_id)["title"]
    store.delete_session(first.store_id)
    assert [second.store_id] == [s["id"] for s in store.sessions()]
    assert [] == store._query("SELECT * FROM steps WHERE message_id NOT IN (SELECT id FROM messages)")
    with pytest.raises(StoreError, match=f"no session with id {first.store_id}"):
        store.delete_session(first.store_id)


def test_repair_marks_interrupted_replies_stopped(tmp_path):
    path = tmp_path / "h.db"
    store = Store.open(path)
    sid = store.create_session("t", "m", "cpu", "float32", {})
    mid = store.add_message(sid, 1, "assistant", "partial", status="in_progress")
    store.add_steps(mid, [dict(phase="decode", idx=0, start_ns=0, latency_ns=5, num_tokens=1, kv_tokens=3,
                               kv_bytes=30, token_id=1, token_text="x", token_prob=0.5)])
    Store.open(path)
    [message] = store.messages(sid)
    assert ("stopped", "interrupted", 1) == (message["status"], message["finish_reason"], len(store.steps(mid)))


def test_a_second_process_repairs_only_the_replies_of_processes_that_are_gone(tmp_path):
    """Two apps on one history file (or an app and a terminal chat): the second's start leaves the first's
    reply in progress, and marks stopped the one of a process that was killed; a session whose reply has
    no live writer can be deleted."""
    path = tmp_path / "h.db"
    Store.open(path).close()
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from app.history.store import Store; store = Store.open(sys.argv[1]); "
        "session = store.create_session('t', 'm', 'cpu', 'float32', {}); store.add_reply(session, 1, 'hi'); "
        "print(session, flush=True); time.sleep(120)"), str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        session = int(writer.stdout.readline())
        store = Store.open(path)  # a second app starts
        assert "in_progress" == store.messages(session)[-1]["status"]
        with pytest.raises(StoreError, match="is replying now"):
            store.delete_session(session)
    finally:
        writer.kill()
        writer.wait()
    Store.open(path)  # a third start: the writer is gone, its reply is stopped
    assert ("stopped", "interrupted", None) == tuple(store.messages(session)[-1][k]
                                                     for k in ("status", "finish_reason", "writer"))
    store.delete_session(session)


def test_commands_that_only_read_leave_a_reply_being_written_as_it_is(tmp_path):
    """`phasescope sessions` or `export` in a terminal while the app replies: the reply stays in progress
    (repair would have marked it stopped, and it could then be deleted under the app's writes)."""
    path = tmp_path / "h.db"
    store = Store.open(path)
    sid = store.create_session("t", "m", "cpu", "float32", {})
    store.add_reply(sid, 1, "hi")
    for command in (["sessions"], ["export", "--all", "--format", "csv"]):
        out = subprocess.run([sys.executable, "-m", "app.cli", *command, "--db", str(path)], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
    assert "in_progress" == store.messages(sid)[-1]["status"]


def test_new_file_is_created_at_the_latest_version_in_wal_mode(tmp_path):
    store = Store.open(tmp_path / "new" / "history.db")
    assert LATEST_VERSION == store.version
    assert "wal" == store.db.journal_mode
    assert {"sessions", "messages", "steps"} <= set(store.db.table_names())


def test_a_new_history_is_readable_by_its_owner_alone_and_an_old_one_keeps_its_mode(tmp_path):
    store = Store.open(tmp_path / "new" / "history.db")
    store.create_session("Private", "m", "cpu", "float32", {})
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "new").iterdir()}
    assert modes == {"history.db": 0o600, "history.db-wal": 0o600, "history.db-shm": 0o600}
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared.db"
    shared.touch(mode=0o644)
    shared.chmod(0o644)
    Store.open(shared)
    assert shared.stat().st_mode & 0o777 == 0o644


def test_the_history_an_earlier_version_made_in_the_apps_place_becomes_private(tmp_path, monkeypatch):
    monkeypatch.delenv("PHASESCOPE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    folder = tmp_path / "phasescope"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    Store.open(folder / "history.db").close()  # as a user's --db: made private, as every new file is
    (folder / "history.db").chmod(0o644)  # as an earlier version left it
    Store.open().close()
    assert (folder.stat().st_mode & 0o777, (folder / "history.db").stat().st_mode & 0o777) == (0o700, 0o600)


def test_migrates_an_empty_file(tmp_path):
    path = tmp_path / "empty.db"
    path.touch()
    assert LATEST_VERSION == Store.open(path).version


def test_migrates_the_first_schema_version_keeping_data(tmp_path):
    from sqlite_utils import Database

    path = tmp_path / "v1.db"
    db = Database(path)
    MIGRATIONS[0](db)
    db.execute("PRAGMA user_version = 1")
    db["sessions"].insert(dict(id=1, title="old chat", created_at="2026-01-01T00:00:00+00:00",
                               updated_at="2026-01-01T00:00:00+00:00", model="m", device="cpu", dtype="float32",
                               settings="{}"))
    db["messages"].insert(dict(id=1, session_id=1, turn=1, role="assistant", content="hello", status="complete",
                               created_at="2026-01-01T00:00:00+00:00", prompt_tokens=3, generated_tokens=1))
    db.conn.close()
    store = Store.open(path)
    assert LATEST_VERSION == store.version
    [message] = store.messages(1)
    assert ("hello", None, None) == (message["content"], message["kv_capacity_tokens"], message["error"])
    assert "old chat" == store.session(1)["title"]
    assert ["idx_messages_session_id_turn"] == [index.name for index in store.db["messages"].indexes]
    store.delete_session(1)
    assert 2 == store.create_session("new chat", "m", "cpu", "float32", {})  # not the deleted chat's id


def test_a_deleted_session_id_is_never_given_again(store):
    """A tab that still holds a deleted session's id (a chat going on, a row selected in History) must not
    find a stranger's session under it."""
    first = store.create_session("first", "m", "cpu", "float32", {})
    newest = store.create_session("newest", "m", "cpu", "float32", {})
    reply = store.add_reply(newest, 1, "hi")
    store.update_message(reply, status="complete")
    store.delete_session(newest)
    after = store.create_session("after", "m", "cpu", "float32", {})
    assert after > newest > first
    assert store.add_reply(after, 1, "hello") > reply


def test_a_session_key_names_the_session_in_its_own_database_alone(tmp_path):
    """What a reloaded tab sends to find its chat (app/ui/history_tab.py, restore): the app restarted with
    another --db, or with a new history file, holds a session of the same id, another chat."""
    one, other = Store.open(str(tmp_path / "one.db")), Store.open(str(tmp_path / "other.db"))
    mine = one.create_session("mine", "m", "cpu", "float32", {})
    time.sleep(0.01)  # a restart takes longer: the key's time is in milliseconds
    stranger = other.create_session("a stranger's", "m", "cpu", "float32", {})
    assert mine == stranger
    key = one.session_key(mine)
    assert mine == one.session_by_key(key)
    assert other.session_by_key(key) is None
    for damaged in ("", str(mine), f"{mine}@", f"x@{key}", "@" + key.partition("@")[2]):
        assert one.session_by_key(damaged) is None


def test_a_session_is_not_deleted_while_it_replies(store):
    session = store.create_session("t", "m", "cpu", "float32", {})
    reply = store.add_reply(session, 1, "hi")
    with pytest.raises(StoreError, match=f"session {session} is replying now; delete it when the reply has ended"):
        store.delete_session(session)
    assert ["hi", ""] == [m["content"] for m in store.messages(session)]
    store.update_message(reply, status="stopped")
    store.delete_session(session)
    assert not store.has_session(session)


def test_a_file_that_is_not_sqlite_is_refused_and_untouched(tmp_path):
    path = tmp_path / "notes.db"
    path.write_bytes(b"my precious notes\n" * 100)
    with pytest.raises(StoreError, match="is not a SQLite database; it was left untouched"):
        Store.open(path)
    assert b"my precious notes\n" * 100 == path.read_bytes()


def test_a_newer_schema_is_refused_and_untouched(tmp_path):
    path = tmp_path / "future.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE future (x)")
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match=rf"newer PhaseScope \(schema 99, this one knows {LATEST_VERSION}\)"):
        Store.open(path)
    assert before == path.read_bytes()


def test_an_unwritable_location_names_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match=f"cannot create the history database {blocker}/sub/history.db"):
        Store.open(blocker / "sub" / "history.db")


def test_a_read_only_folder_names_the_path(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    with pytest.raises(StoreError, match=str(folder / "history.db")):
        Store.open(folder / "history.db")


def test_a_session_opened_where_it_did_not_run_says_where_it_goes_on():
    """Open in chat keeps the chat's backend (the model line's); a session that ran elsewhere is told so."""
    from types import SimpleNamespace

    from app.ui.history_tab import backend_note

    llama = SimpleNamespace(url="http://127.0.0.1:8080/v1")
    assert backend_note("cpu", None) is None and backend_note("endpoint http://127.0.0.1:8080/v1", llama) is None
    assert backend_note("endpoint http://127.0.0.1:8080/v1", None) == (
        "This session ran on http://127.0.0.1:8080/v1; it goes on with this machine's engine, as the model line "
        "says (Backend chooses).")
    assert backend_note("cpu", llama, "zh") == (
        "此会话曾在 本机引擎 上运行；现在继续使用 http://127.0.0.1:8080/v1，与模型信息行一致（可在“后端”中更改）。")


def test_the_history_table_shows_the_most_recent_sessions_and_says_how_many_there_are(tmp_path):
    """The page copies the table's whole value at every event: it holds the most recent sessions only,
    and says so when there are more (search finds the others)."""
    from app.ui.history_tab import SHOWN_SESSIONS, session_rows, sessions_table

    store = Store.open(str(tmp_path / "h.db"))
    ids = [store.create_session(f"chat {i}", "m", "cpu", "int8", {}) for i in range(SHOWN_SESSIONS + 5)]
    rows, total = session_rows(store)
    assert (SHOWN_SESSIONS, SHOWN_SESSIONS + 5) == (len(rows), total)
    assert ids[-1] == rows[0][0]  # newest first
    table = sessions_table(store, "", "en")
    assert f"The {SHOWN_SESSIONS} most recent of {SHOWN_SESSIONS + 5} sessions" in table.label and table.show_label
    assert [["chat 0"]] == [[row[1]] for row in session_rows(store, "chat 0")[0]]  # search reaches the old ones
    found = sessions_table(store, "chat 0", "en")  # all of them shown: no note, the label only a screen reader's
    assert ("Sessions", False) == (found.label, found.show_label)
    store.create_session("remote", "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "endpoint http://h/v1", "", {})
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" == session_rows(store, "remote")[0][0][3]  # a path: its file's name
