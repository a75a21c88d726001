"""Exports of stored sessions: CSV (one row per step), JSON (sessions → messages → steps, with
summary metrics), and a Chrome Trace Event Format timeline that Perfetto and chrome://tracing open."""
from __future__ import annotations

import csv
import io
import json
import os
import re
import threading
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TextIO

from engine.metrics import RequestMetrics, percentiles

from .recorder import message_metrics, replies_summary
from .store import Store

FORMATS = ("csv", "json", "trace")
CSV_COLUMNS = ["session_id", "message_id", "turn", "phase", "index", "start_ms", "latency_ms", "tokens",
               "kv_tokens", "kv_bytes", "token_id", "token_text", "token_prob", "batch_size", "cached_prompt_tokens",
               "replaced_by", "precision", "switches", "held_ms", "step_held_ms"]
DEFINITIONS = {
    "ttft_ms": "request submitted -> first generated token available",
    "itl_ms": "gap between two successive generated tokens",
    "tpot_ms": "(e2e_ms - ttft_ms) / (generated tokens - 1)",
    "e2e_ms": "request submitted -> last token",
    "prefill_tokens_per_s": "prompt tokens prefilled (cached ones left out) / prefill forward time",
    "decode_tokens_per_s": "(generated tokens - 1) / (e2e_ms - ttft_ms)",
    "start_ms": "step start, from the request's submission",
    "batch_size": "sequences decoded together in the step that produced this token",
    "cached_prompt_tokens": "prompt tokens whose KV came from the cache (prefix caching), not prefilled",
    "replaced_by": "the reply that took this message's place: Retry's (same turn), or an edited message's (this "
                   "turn or an earlier one); empty for the messages kept",
    "engine": "how the local engine ran the reply: the weights' precision and the switches set away from their "
              "defaults (CSV: precision, and switches as JSON); none for a remote endpoint's and older replies",
    "held_ms": "ms the reply waited, by name, while a measurement held the engine (the Lab's, a precision "
               "check's): its ttft_ms or tpot_ms include them; none where it waited for none",
    "step_held_ms": "of a step's latency_ms, the ms it waited for such a measurement (JSON: each step's held_ms); "
                    "none where it waited for none",
    "settings": "a reply's: what it was asked with, the system prompt sent (null: none; a model's chat template "
                "may add its own) and the sampling, none for replies saved before it was; a session's: the "
                "sampling of its first reply",
    "summary": "a session's p50/p90/p99 of ttft_ms, tpot_ms, itl_ms and e2e_ms over its replies (replaced ones too)",
}


def export_filename(fmt: str, session_id: int | None) -> str:
    """A file name with no user text in it: it cannot form a path."""
    scope = f"session-{int(session_id)}" if session_id is not None else "all-sessions"
    return f"phasescope-{scope}.{'trace.json' if fmt == 'trace' else fmt}"


def _listed(store: Store, session_id: int | None) -> list[dict]:
    """The sessions to export: one, or all, oldest first."""
    if session_id is not None:
        return [store.session(session_id)]  # raises StoreError for an unknown id
    return list(reversed(store.sessions()))


# A session as it is exported: its row, and its messages, each with its steps
Session = tuple[dict, list[tuple[dict, list[dict]]]]


def _read(store: Store, listed: list[dict]) -> Iterator[Session]:
    """Each listed session with its messages and their steps, read a session at a time as the export is
    written: an export of every session holds one in memory, not all (the JSON of a history of 1.2 M steps,
    built whole, took 4.9 GB and 41 s). One deleted since it was listed is left out."""
    for listed_row in listed:
        if store.has_session(listed_row["id"]):
            session = store.session(listed_row["id"])  # its own row: the listing adds the table's figures
            yield session, [(m, store.steps(m["id"])) for m in store.messages(session["id"])]


def _csv(out: TextIO, sessions: Iterable[Session]) -> None:
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for session, messages in sessions:
        sid = session["id"]
        for message, steps in messages:
            engine = json.loads(message["engine"]) if message.get("engine") else {}
            precision = engine.pop("precision", "")
            switches = json.dumps(engine, sort_keys=True) if engine else ""
            writer.writerows([sid, message["id"], message["turn"], step["phase"], step["idx"],
                              step["start_ns"] / 1e6, step["latency_ns"] / 1e6, step["num_tokens"],
                              step["kv_tokens"], step["kv_bytes"], step["token_id"], step["token_text"],
                              step["token_prob"], step["batch_size"], message["cached_prompt_tokens"],
                              message["replaced_by"], precision, switches, message.get("held_ms"),
                              _ms(step.get("held_ns"))] for step in steps)


def _message_json(message: dict, steps: list[dict], m: RequestMetrics | None) -> dict:
    """A message with its steps, and a reply with its metrics m (None for the user's messages)."""
    summary = None if m is None else {
        "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms, "e2e_ms": m.e2e_ms,
        "itl_ms": percentiles(m.itl_ms), "prefill_tokens_per_s": m.prefill_tokens_per_s,
        "decode_tokens_per_s": m.decode_tokens_per_s, "num_prompt_tokens": m.num_prompt_tokens,
        "num_generated_tokens": m.num_generated_tokens, "num_cached_tokens": m.num_cached_tokens,
        "kv_tokens": m.kv_tokens, "kv_bytes": m.kv_bytes}
    message = {key: value for key, value in message.items() if key != "writer"}  # a host and a pid, while it ran
    # JSON text in the file: {"precision": "int8", ...}, {"lab": 3201.7}, {"system": ..., "temperature": 0.7, ...}
    for key in ("engine", "held_ms", "settings"):
        if key in message:
            message[key] = json.loads(message[key]) if message[key] else None
    return {**message, "metrics": summary,
            "steps": [{**s, "start_ms": s["start_ns"] / 1e6, "latency_ms": s["latency_ns"] / 1e6,
                       "held_ms": _ms(s.get("held_ns"))} for s in steps]}


def _ms(ns: int | None) -> float | None:
    """A stored duration in ns as ms; None where there is none (the CSV writes it as an empty cell)."""
    return None if ns is None else ns / 1e6


def _session_json(session: dict, messages_rows: list[tuple[dict, list[dict]]]) -> dict:
    metrics = [message_metrics(m, steps) if m["role"] == "assistant" else None for m, steps in messages_rows]
    messages = [_message_json(m, steps, metric) for (m, steps), metric in zip(messages_rows, metrics)]
    # the History tab shows these (to_json), made from the metrics above: each step is read once
    replies, percentiles_of = replies_summary([m for m in metrics if m is not None])
    return {**session, "settings": json.loads(session["settings"] or "{}"),
            "summary": {"replies": replies, **percentiles_of}, "messages": messages}


def _epoch_us(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp() * 1e6


def _trace_events(session: dict, message: dict, steps: list[dict], origin_us: float) -> list[dict]:
    pid, tid = session["id"], message["id"]
    base_us = _epoch_us(message["created_at"]) - origin_us  # small numbers keep sub-microsecond precision
    events = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
               "args": {"name": f"turn {message['turn']} · message {tid}"}}]
    prefill_end_ns = 0
    for step in steps:
        start_ns, end_ns = step["start_ns"], step["start_ns"] + step["latency_ns"]
        if step["phase"] == "prefill":
            prefill_end_ns = end_ns
            name, args = f"prefill chunk {step['idx']}", {"tokens": step["num_tokens"]}
        else:
            # token 1's latency is the TTFT; on the timeline it is the first sample, after the prefill
            start_ns = max(start_ns, prefill_end_ns) if step["idx"] == 0 else start_ns
            name, args = f"decode {step['idx']}", {"token_id": step["token_id"], "text": step["token_text"],
                                                    "prob": step["token_prob"], "batch_size": step["batch_size"]}
        ts, dur = base_us + start_ns / 1e3, (end_ns - start_ns) / 1e3
        events.append({"name": name, "cat": step["phase"], "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid,
                       "args": {**args, "latency_ms": step["latency_ns"] / 1e6, "kv_tokens": step["kv_tokens"],
                                "kv_bytes": step["kv_bytes"]}})
        if step.get("held_ns"):  # the step waited for a measurement (the Lab's) first: a slice inside its own
            events.append({"name": "waiting for a measurement", "cat": "held", "ph": "X", "ts": ts,
                           "dur": min(step["held_ns"] / 1e3, dur), "pid": pid, "tid": tid,
                           "args": {"held_ms": step["held_ns"] / 1e6}})
        events.append({"name": "KV cache bytes", "ph": "C", "ts": ts + dur, "pid": pid, "tid": tid,
                       "args": {"kv_bytes": step["kv_bytes"]}})
    return events


def _trace(store: Store, listed: list[dict], session_id: int | None) -> Iterator[dict]:
    """The Chrome Trace Event Format's events of the listed sessions: a process per session, a thread per
    reply, steps as "X" events, the KV cache size as a "C" counter; timestamps in microseconds from the first
    exported reply's start."""
    origin = store.first_reply_at(session_id)
    origin_us = _epoch_us(origin) if origin else 0.0
    yield from ({"name": "process_name", "ph": "M", "pid": s["id"], "tid": 0,
                 "args": {"name": f"session {s['id']}: {s['title']}"}} for s in listed)
    for session, messages in _read(store, listed):
        for message, steps in messages:
            if message["role"] == "assistant":
                yield from _trace_events(session, message, steps, origin_us)


def max_export_steps() -> int:
    """The most steps one export may hold (each 70-350 bytes written: CSV the fewest, the trace the most):
    PHASESCOPE_MAX_EXPORT_STEPS."""
    return int(os.environ.get("PHASESCOPE_MAX_EXPORT_STEPS", 2_000_000))


def check_size(store: Store, session_id: int | None = None) -> None:
    """Refuse an export larger than the limit before writing any of it."""
    count = store.count_steps(session_id)
    limit = max_export_steps()
    if count > limit:
        raise ValueError(f"the export would hold {count:,} steps, over the limit of {limit:,} "
                         "(PHASESCOPE_MAX_EXPORT_STEPS): export one session at a time")


JSON_HEAD = {"format": "phasescope-export", "version": 1, "definitions": DEFINITIONS}
TRACE_TAIL = {"displayTimeUnit": "ms", "otherData": {"source": "PhaseScope", "origin": "first exported message"}}
_STEPS_HELD = re.compile(r'"steps": "\\u0000(\d+)\\u0000"')  # where _session_text puts a message's steps


def _session_text(session: dict) -> str:
    """A session as the JSON file lays it out: indented by one space a level, but a step on one line (a step's
    15 fields took 17 lines, and json.dumps indents in Python, about 10x slower than in C on one line)."""
    steps = []
    for message in session["messages"]:
        steps.append(message["steps"])
        message["steps"] = f"\0{len(steps) - 1}\0"  # in the text: "\u0000N\u0000", never a key's value else
    text = json.dumps(session, ensure_ascii=False, indent=1)

    def laid_out(held: re.Match) -> str:  # a message's steps are four levels in, its closing bracket three
        rows = steps[int(held[1])]
        return '"steps": ' + ("[\n" + ",\n".join("    " + json.dumps(step, ensure_ascii=False) for step in rows)
                              + "\n   ]" if rows else "[]")

    return _STEPS_HELD.sub(laid_out, text)


def _write_list(out: TextIO, data: dict, key: str, texts: Iterable[str], indent: int | None) -> None:
    """The JSON of data with data[key] a list of the items whose JSON texts are texts, laid out as json.dumps
    lays it out with indent (data's own values are the export's few fixed ones), written an item at a time."""
    head, tail = json.dumps({**data, key: []}, ensure_ascii=False, indent=indent).rsplit("[]", 1)
    # the items are two levels in: the value of a key of the outer object
    before, between, after = ("\n" + " " * 2 * indent, ",\n" + " " * 2 * indent, "\n" + " " * indent) if indent \
        else ("", ", ", "")
    out.write(head + "[")
    first = True
    for text in texts:
        out.write((before if first else between) + (text.replace("\n", before) if indent else text))
        first = False
    out.write(("" if first else after) + "]" + tail)


def _checked(store: Store, session_id: int | None) -> list[dict]:
    """The sessions to export (raises for an unknown one), after the size check: before anything is written."""
    listed = _listed(store, session_id)
    check_size(store, session_id)
    return listed


def write_to(out: TextIO, store: Store, fmt: str, session_id: int | None = None) -> None:
    """The export of one session (session_id) or all in one format (FORMATS) into a text stream, a session
    at a time (see _read); nothing is written where it raises for an unknown format or session, or for an
    export over the limit."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    listed = _checked(store, session_id)
    if fmt == "csv":
        _csv(out, _read(store, listed))
    elif fmt == "json":
        texts = (_session_text(_session_json(*session)) for session in _read(store, listed))
        _write_list(out, JSON_HEAD, "sessions", texts, indent=1)
    else:
        events = (json.dumps(event, ensure_ascii=False) for event in _trace(store, listed, session_id))
        _write_list(out, {"traceEvents": [], **TRACE_TAIL}, "traceEvents", events, indent=None)


def render(store: Store, fmt: str, session_id: int | None = None) -> str:
    out = io.StringIO()
    write_to(out, store, fmt, session_id)
    return out.getvalue()


def to_csv(store: Store, session_id: int | None = None) -> str:
    return render(store, "csv", session_id)


def to_json(store: Store, session_id: int | None = None) -> dict:
    """Sessions → messages → steps, with summary metrics (the JSON export's data; what the History tab shows
    of a session)."""
    return {**JSON_HEAD, "sessions": [_session_json(*s) for s in _read(store, _checked(store, session_id))]}


def write_export(store: Store, fmt: str, path: Path, session_id: int | None = None, force: bool = False) -> Path:
    if path.is_dir():  # a folder: the file goes in it, named as the History tab names it
        path = path / export_filename(fmt, session_id)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it")
    if path.exists() and not path.is_file():  # a pipe or a device (-o /dev/stdout): written in place
        with path.open("w", encoding="utf-8", newline="") as out:
            write_to(out, store, fmt, session_id)
        return path
    # its own scratch file: the app writes each export under one name, for any page that asks at the time
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:  # beside it, then in its place: a full disk fails before the file it replaces is touched
        with scratch.open("w", encoding="utf-8", newline="") as out:
            write_to(out, store, fmt, session_id)
        os.replace(scratch, path)
    except OSError as exc:
        scratch.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None  # the user's file, not the scratch
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    return path
