"""The history database: sessions, their messages, and every prefill chunk and decode step; and the
Optimization Lab's runs.

One SQLite file in WAL mode, so that a reader never blocks the writer and a killed process loses at
most the batch of steps it had not yet written. The schema is versioned with `PRAGMA user_version`
and brought up to date by the migrations below, in order. A file that is not SQLite, or that a
newer PhaseScope wrote, is refused and left untouched.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from sqlite_utils import Database

from engine import valid_text

from .errors import SessionMoved, SessionReplying, StoreError

SQLITE_HEADER = b"SQLite format 3\x00"
FINAL_STATUS = {"eos": "complete", "length": "complete", "stop": "complete", "cancelled": "stopped",
                "error": "error"}


def default_db_path() -> Path:
    if os.environ.get("PHASESCOPE_DB"):
        return Path(os.environ["PHASESCOPE_DB"]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "phasescope" / "history.db"


def clean(text: str | None) -> str | None:
    """Text SQLite can hold: a lone surrogate (which JSON and some clients can carry) becomes U+FFFD, as
    the engine does for its tokenizer."""
    return None if text is None else valid_text(text)


def model_name(model: str) -> str:
    """A session's model as the lists show it: a path's last part (llama-server names a model by its GGUF
    file's path; a Hugging Face id's last part is its name)."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _v1(db: Database) -> None:
    """The first schema: sessions, messages, steps."""
    db["sessions"].create({"id": int, "title": str, "created_at": str, "updated_at": str, "model": str,
                           "device": str, "dtype": str, "settings": str}, pk="id")
    db["messages"].create({"id": int, "session_id": int, "turn": int, "role": str, "content": str, "status": str,
                           "created_at": str, "prompt_tokens": int, "cached_prompt_tokens": int,
                           "generated_tokens": int, "ttft_ms": float, "tpot_ms": float, "e2e_ms": float,
                           "finish_reason": str}, pk="id", foreign_keys=[("session_id", "sessions", "id")])
    db["steps"].create({"message_id": int, "phase": str, "idx": int, "start_ns": int, "latency_ns": int,
                        "num_tokens": int, "kv_tokens": int, "kv_bytes": int, "token_id": int, "token_text": str,
                        "token_prob": float}, pk=("message_id", "phase", "idx"),
                       foreign_keys=[("message_id", "messages", "id")])


def _v2(db: Database) -> None:
    """What the charts and exports need beyond v1: the KV capacity, the TTFT breakdown, the error."""
    for column, kind in [("kv_capacity_tokens", int), ("kv_capacity_bytes", int), ("tokenize_ms", float),
                         ("queue_ms", float), ("prefill_ms", float), ("error", str)]:
        db["messages"].add_column(column, kind)
    db["messages"].create_index(["session_id", "turn"])


def _v3(db: Database) -> None:
    """The scheduler: how many sequences shared each decode step (prompt tokens taken from the cache
    were already in v1's messages.cached_prompt_tokens)."""
    db["steps"].add_column("batch_size", int)


def _v4(db: Database) -> None:
    """The Optimization Lab's runs: which experiment, under which settings, on which machine, and what it
    measured (JSON: the figure is drawn again from the results)."""
    db["lab_runs"].create({"id": int, "created_at": str, "experiment": str, "settings": str, "machine": str,
                           "results": str}, pk="id")
    db["lab_runs"].create_index(["experiment"])


def _v5(db: Database) -> None:
    """Retry: a turn's reply that a later one replaced keeps its row and steps (its timings were
    measured), with the id of the reply that took its place."""
    db["messages"].add_column("replaced_by", int)


def _v6(db: Database) -> None:
    """Ids are never given twice (AUTOINCREMENT): SQLite gives a new row the highest id + 1, so the id of
    the newest session, once deleted, went to the next one, and a tab that still held the old id (a chat
    going on, a row selected in History) wrote to or deleted a stranger's session. SQLite cannot add
    AUTOINCREMENT to a table: sessions and messages are copied into new tables that have it."""
    for table in ("sessions", "messages"):
        sql = db.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", [table]).fetchone()[0]
        primary_key = '"id" INTEGER PRIMARY KEY,'
        assert primary_key in sql, sql
        sql = sql.replace(primary_key, '"id" INTEGER PRIMARY KEY AUTOINCREMENT,', 1)
        db.execute(sql.replace(f'"{table}"', f'"{table}_v6"', 1))
        db.execute(f'INSERT INTO "{table}_v6" SELECT * FROM "{table}"')  # sets sqlite_sequence to the highest id
        db.execute(f'DROP TABLE "{table}"')
        db.execute(f'ALTER TABLE "{table}_v6" RENAME TO "{table}"')
    db["messages"].create_index(["session_id", "turn"])


def _v7(db: Database) -> None:
    """A reply in progress names the process writing it (writer: host, pid and start): a process opening
    the file marks stopped only the replies of processes that are gone, not those another app or a
    terminal chat is writing meanwhile."""
    db["messages"].add_column("writer", str)


def _v8(db: Database) -> None:
    """How the engine ran each reply (engine: JSON, its precision and the switches set away from their
    defaults): int8 and fp32 replies, or a reply without a KV cache, are told apart in the history and
    its exports. Replies from before it, and a remote endpoint's, have none."""
    db["messages"].add_column("engine", str)


def _v9(db: Database) -> None:
    """How long a reply waited for a measurement that held the engine (the Lab's, a precision check's),
    which its TTFT or TPOT include: held_ms, JSON by name ({"lab": 3201.7}), as its Finished event said;
    None where it waited for none."""
    db["messages"].add_column("held_ms", str)


def _v10(db: Database) -> None:
    """Where that wait fell: held_ns, the part of a decode step's latency spent waiting for a measurement
    (DecodeStep.held_ms), so that a reopened reply marks the step in its latency chart as it was marked
    live; None where the step waited for none."""
    db["steps"].add_column("held_ns", int)


def _v11(db: Database) -> None:
    """What each reply was asked with (settings, JSON): the system prompt sent (None: none) and the sampling,
    so that a chat opened again goes on as it was asked (its system prompt is the start of every prompt:
    without it the prefix cache missed and the model saw another conversation), and its exports say how its
    prompt tokens were made up. The session's settings are its first reply's sampling; replies from before
    it have none."""
    db["messages"].add_column("settings", str)


MIGRATIONS: list[Callable[[Database], None]] = [_v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9, _v10, _v11]
LATEST_VERSION = len(MIGRATIONS)

# a step's columns, in the order add_steps writes them (token_text, token_prob, batch_size and held_ns last)
STEP_FIELDS = ("message_id", "phase", "idx", "start_ns", "latency_ns", "num_tokens", "kv_tokens", "kv_bytes",
               "token_id", "token_text", "token_prob", "batch_size", "held_ns")
_INSERT_STEPS = f"INSERT INTO steps ({', '.join(STEP_FIELDS)}) VALUES ({', '.join('?' * len(STEP_FIELDS))})"


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise StoreError(f"history database {path} is a folder, not a file")
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as f:
            if f.read(16) != SQLITE_HEADER:
                raise StoreError(f"{path} is not a SQLite database; it was left untouched (choose another with --db)")


def _create_private(path: Path) -> None:
    """A new history file is readable by its owner alone (0600, and its folder 0700 where made here), as a
    shell's history is: it holds the user's conversations, and a class's machine has other users. SQLite
    gives the -wal and -shm files the database's mode. A file that exists keeps the mode it has."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # empty: SQLite takes it as new
    except FileExistsError:
        pass


def _make_private(path: Path) -> None:
    """The history in the app's own place, made by an earlier version with the umask's mode (-rw-r--r--
    in a drwxr-xr-x folder), becomes its owner's alone as a new one is. A file the user placed keeps its
    mode."""
    for item in (path.parent, path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            mode = item.stat().st_mode & 0o777
            if mode & 0o077:
                item.chmod(mode & 0o700)
        except OSError:  # not there (no -wal yet), or not the user's to change: left as it is
            pass


def _started(pid: int) -> str:
    """When a process started (clock ticks after boot, from Linux's /proc), so that a pid the system
    gave again names another process; "" where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return ""


def _this_writer() -> str:
    """This process, as the writer of a reply in progress (Store.add_reply; cleared when it ends)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_started(os.getpid())}"


def _is_running(writer: str | None) -> bool:
    """Whether the process that wrote writer runs on this machine still. One on another machine (a file on
    a shared drive) cannot be asked: it counts as gone, as every writer did before writers were named."""
    host, _, rest = (writer or "").partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return _started(int(pid)) == started


def _without_id(row: dict) -> dict:
    """A row to insert again as a new one: SQLite gives it the next id."""
    return {name: value for name, value in row.items() if name != "id"}


class Store:
    """A thin class over sqlite-utils. Safe to share between threads (one lock around the connection)."""

    def __init__(self, db: Database, path: Path | None = None) -> None:
        self.db = db
        self.path = path
        self._lock = threading.RLock()

    @classmethod
    def open(cls, path: str | Path | None = None, upgrade: bool = True, create: bool = True,
             repair: bool = True) -> Store:
        """Open the database at path (creating it if needed, unless create is False: commands that only
        read it say that it is missing instead of leaving an empty one behind), migrate it, and repair
        interrupted replies (unless repair is False: a command that only reads the file must not mark
        stopped the replies an app is writing to it meanwhile)."""
        ours = not path and not os.environ.get("PHASESCOPE_DB")  # the app's own place, not one the user chose
        path = Path(path).expanduser() if path else default_db_path()
        if not create and not path.exists():
            raise StoreError(f"no history database at {path} (the first chat makes it; choose another with --db)")
        _check_file(path)
        try:
            _create_private(path)
            if ours:
                _make_private(path)
            store = cls(Database(sqlite3.connect(path, check_same_thread=False, timeout=10)), path)
            store._refuse_newer()
            store.db.enable_wal()
            store.db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable against a killed process
            if upgrade:
                store.migrate()
                if repair:
                    store.repair()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot use the history database {path}: {exc}") from exc
        except OSError as exc:
            raise StoreError(f"cannot create the history database {path}: {exc.strerror or exc}") from exc
        return store

    @contextmanager
    def _write(self) -> Iterator[None]:
        """One write transaction, its lock taken up front (BEGIN IMMEDIATE): with a deferred BEGIN, a
        transaction that reads and then writes fails at once ("database is locked") when another process
        wrote in between, instead of waiting its turn."""
        with self._lock, self._said("write"):
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self.db.conn.rollback()
                raise
            self.db.execute("COMMIT")

    @contextmanager
    def _said(self, doing: str) -> Iterator[None]:
        """SQLite's errors (a full disk, a damaged file, a lock held too long) as a StoreError, one line that
        names the file, which the page and the CLI show as they show the store's other errors."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            hint = (f" (damaged: `sqlite3 {self.path} .recover > saved.sql` keeps what it can)"
                    if "malformed" in str(exc) else "")
            where = f" {self.path}" if self.path else ""
            raise StoreError(f"cannot {doing} the history database{where}: {exc}{hint}") from exc

    def close(self) -> None:
        with self._lock:
            self.db.conn.close()

    @classmethod
    def memory(cls) -> Store:
        store = cls(Database(sqlite3.connect(":memory:", check_same_thread=False)))
        store.migrate()
        return store

    @property
    def version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def _refuse_newer(self) -> None:
        if self.version > LATEST_VERSION:
            raise StoreError(f"{self.path} was written by a newer PhaseScope (schema {self.version}, this one "
                             f"knows {LATEST_VERSION}); it was left untouched")

    def migrate(self) -> None:
        self._refuse_newer()
        with self._write():  # a second process opening the file waits, then finds it migrated
            for version in range(self.version, LATEST_VERSION):
                MIGRATIONS[version](self.db)
                self.db.execute(f"PRAGMA user_version = {version + 1}")

    def repair(self) -> int:
        """Replies left in progress by a killed process become `stopped`, keeping their steps; those of a
        process still running (another app on the same file, a terminal chat) stay as they are."""
        with self._lock:
            gone = [row["id"] for row in self._writing() if not _is_running(row["writer"])]
            if gone:
                self.db.execute("UPDATE messages SET status = 'stopped', finish_reason = 'interrupted', writer = NULL "
                                f"WHERE id IN ({', '.join('?' * len(gone))})", gone)
            return len(gone)

    def _writing(self, session_id: int | None = None) -> list[dict]:
        """The replies in progress (of one session), with their writers."""
        where = "" if session_id is None else " AND session_id = ?"
        return self._query(f"SELECT id, writer FROM messages WHERE status = 'in_progress'{where}",
                           [] if session_id is None else [session_id])

    # --- writing ----------------------------------------------------------------------------------

    def create_session(self, title: str, model: str, device: str, dtype: str, settings: dict) -> int:
        stamp = now_iso()
        with self._lock:
            return self.db["sessions"].insert(dict(title=clean(title[:80]), created_at=stamp, updated_at=stamp,
                                                   model=model, device=device, dtype=dtype,
                                                   settings=json.dumps(settings))).last_pk

    def add_message(self, session_id: int, turn: int, role: str, content: str, status: str = "complete") -> int:
        stamp = now_iso()
        with self._write():
            self.db["sessions"].update(session_id, {"updated_at": stamp})
            return self.db["messages"].insert(dict(session_id=session_id, turn=turn, role=role, content=clean(content),
                                                   status=status, created_at=stamp)).last_pk

    def add_reply(self, session_id: int, turn: int, user_text: str, latest: int | None = None,
                  settings: dict | None = None) -> int:
        """A turn's user message and its assistant reply (in progress), in one transaction; returns the
        reply's id. A turn that has a reply already is being sent again: by Retry, its message as it was
        (it stays), or edited (a new message). The rows the new reply takes the place of are marked
        replaced_by it, kept: the turn's earlier replies, an edited message's earlier text, and every later
        turn (an earlier message edited: the chat went back to it). latest: the session's latest reply as
        the sending chat knows it (None: no reply yet); where the session has another (a second tab
        continued it), SessionMoved is raised and nothing is written. settings: what the reply is asked with
        (see _v11)."""
        stamp, text = now_iso(), clean(user_text)
        with self._write():
            if self._latest_reply(session_id) != latest:
                raise SessionMoved(f"session {session_id} was continued elsewhere")
            self.db["sessions"].update(session_id, {"updated_at": stamp})
            asked = self.db.execute("SELECT id, content FROM messages WHERE session_id = ? AND turn = ? "
                                    "AND role = 'user' AND replaced_by IS NULL", [session_id, turn]).fetchone()
            if asked is not None and asked[1] == text:  # Retry: the message as it was
                asked_id = asked[0]
            else:  # a new turn, or an edited message
                asked_id = self.db["messages"].insert(dict(session_id=session_id, turn=turn, role="user", content=text,
                                                           status="complete", created_at=stamp)).last_pk
            reply = dict(session_id=session_id, turn=turn, role="assistant", content="", status="in_progress",
                         created_at=stamp, writer=_this_writer(),
                         settings=None if settings is None else clean(json.dumps(settings, ensure_ascii=False)))
            reply_id = self.db["messages"].insert(reply).last_pk
            self.db.execute("UPDATE messages SET replaced_by = ? WHERE session_id = ? AND turn >= ? "
                            "AND replaced_by IS NULL AND id NOT IN (?, ?)", [reply_id, session_id, turn, asked_id,
                                                                             reply_id])
            return reply_id

    def fork_session(self, session_id: int, before_turn: int) -> int:
        """A new session holding a copy of this one's turns before before_turn (each turn's reply that no
        Retry replaced, with its steps): where a chat goes on that another tab has continued meanwhile.
        Returns the new session's id."""
        stamp = now_iso()
        with self._write():
            old = self.session(session_id)
            new_id = self.db["sessions"].insert({**_without_id(old), "created_at": stamp, "updated_at": stamp}).last_pk
            kept = self.db.execute("SELECT * FROM messages WHERE session_id = ? AND turn < ? AND replaced_by IS NULL "
                                   "ORDER BY turn, id", [session_id, before_turn])
            columns = [column[0] for column in kept.description]
            for row in kept.fetchall():
                message = dict(zip(columns, row))
                copy_id = self.db["messages"].insert({**_without_id(message), "session_id": new_id}).last_pk
                self.db.execute(f"INSERT INTO steps ({', '.join(STEP_FIELDS)}) SELECT ?, "
                                f"{', '.join(STEP_FIELDS[1:])} FROM steps WHERE message_id = ?",
                                [copy_id, message["id"]])
            return new_id

    def update_message(self, message_id: int, **fields) -> None:
        fields = {k: clean(v) if isinstance(v, str) else v for k, v in fields.items()}
        with self._lock:
            self.db["messages"].update(message_id, fields)

    def add_steps(self, message_id: int, rows: Iterable[dict], **message_fields) -> None:
        """Append steps (and update the message) in one transaction."""
        message_fields = {k: clean(v) if isinstance(v, str) else v for k, v in message_fields.items()}
        # plain SQL with the columns named once: sqlite-utils' insert_all looks at every value of every row and
        # its update reads the row first (333 -> 113 us for 32 steps), and this runs on the engine's thread
        # between decode steps. The names are this module's and the recorder's, never a user's.
        values = [(message_id, *(row.get(name) for name in STEP_FIELDS[1:-4]), clean(row.get("token_text")),
                   row.get("token_prob"), row.get("batch_size"), row.get("held_ns")) for row in rows]
        with self._write():
            self.db.conn.executemany(_INSERT_STEPS, values)
            if message_fields:
                assignments = ", ".join(f"[{name}] = ?" for name in message_fields)
                self.db.conn.execute(f"UPDATE messages SET {assignments} WHERE id = ?",
                                     [*message_fields.values(), message_id])

    def rename_session(self, session_id: int, title: str) -> None:
        self.session(session_id)
        with self._lock:
            self.db["sessions"].update(session_id, {"title": clean(title.strip()[:80]) or "Untitled"})

    def delete_session(self, session_id: int) -> None:
        """Delete a session with its messages and steps; refused while one of its replies is being written
        (by a chat in another tab, or another process), whose steps would be left behind with no message."""
        self.session(session_id)
        with self._write():
            if any(_is_running(row["writer"]) for row in self._writing(session_id)):
                raise SessionReplying(f"session {session_id} is replying now; delete it when the reply has ended")
            self.db.execute("DELETE FROM steps WHERE message_id IN (SELECT id FROM messages WHERE session_id = ?)",
                            [session_id])
            self.db.execute("DELETE FROM messages WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM sessions WHERE id = ?", [session_id])

    def add_lab_run(self, experiment: str, settings: dict, machine: dict, results: dict) -> int:
        with self._lock:
            return self.db["lab_runs"].insert(dict(created_at=now_iso(), experiment=experiment,
                                                   settings=json.dumps(settings), machine=json.dumps(machine),
                                                   results=json.dumps(results))).last_pk

    # --- reading ----------------------------------------------------------------------------------

    def _query(self, sql: str, params: list | dict | None = None) -> list[dict]:
        with self._lock, self._said("read"):
            return list(self.db.query(sql, params))

    def sessions(self, search: str = "") -> list[dict]:
        """Newest first, with turns, mean TTFT/TPOT (of the replies a Retry did not replace) and the
        precisions those replies ran in ("int8,fp32"; None where none was recorded); search matches titles
        and message text."""
        words = clean(search.strip())
        # the text itself: % and _ are LIKE's wildcards, so "50%" would match every "50"
        like = "%" + words.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        return self._query(
            "SELECT s.*, COUNT(m.id) AS turns, AVG(m.ttft_ms) AS mean_ttft_ms, AVG(m.tpot_ms) AS mean_tpot_ms, "
            "GROUP_CONCAT(DISTINCT json_extract(m.engine, '$.precision')) AS precisions "
            "FROM sessions s LEFT JOIN messages m ON m.session_id = s.id AND m.role = 'assistant' "
            "AND m.replaced_by IS NULL "
            "WHERE ? = '' OR s.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages x "
            "WHERE x.session_id = s.id AND x.content LIKE ? ESCAPE '\\') "
            "GROUP BY s.id ORDER BY s.updated_at DESC, s.id DESC", [words, like, like])

    def session(self, session_id: int) -> dict:
        rows = self._query("SELECT * FROM sessions WHERE id = ?", [session_id])
        if not rows:
            raise StoreError(f"no session with id {session_id}")
        return rows[0]

    def _latest_reply(self, session_id: int) -> int | None:
        """The id of the session's newest reply that no Retry replaced; None before its first."""
        return self.db.execute("SELECT MAX(id) FROM messages WHERE session_id = ? AND role = 'assistant' "
                               "AND replaced_by IS NULL", [session_id]).fetchone()[0]

    def latest_reply(self, session_id: int) -> int | None:
        with self._lock, self._said("read"):
            return self._latest_reply(session_id)

    def has_session(self, session_id: int) -> bool:
        return bool(self._query("SELECT 1 FROM sessions WHERE id = ?", [session_id]))

    def session_key(self, session_id: int) -> str:
        """The session's id with when it was created: what a browser tab keeps to show its chat again after a
        reload (app/ui/history_tab.py, restore). An id alone names another chat in another database: the app
        restarted with another --db, or with a new one after the history file was removed."""
        return f"{session_id}@{self.session(session_id)['created_at']}"

    def session_by_key(self, key: str) -> int | None:
        """The id of the session session_key named, None where this database has no such session."""
        session_id, _, created = key.partition("@")
        if not session_id.isdigit():
            return None
        rows = self._query("SELECT id FROM sessions WHERE id = ? AND created_at = ?", [int(session_id), created])
        return rows[0]["id"] if rows else None

    def messages(self, session_id: int) -> list[dict]:
        return self._query("SELECT * FROM messages WHERE session_id = ? ORDER BY turn, id", [session_id])

    def steps(self, message_id: int) -> list[dict]:
        return self._query("SELECT * FROM steps WHERE message_id = ? ORDER BY CASE phase WHEN 'prefill' THEN 0 "
                           "ELSE 1 END, idx", [message_id])

    def first_reply_at(self, session_id: int | None = None) -> str | None:
        """When the first reply (of one session, or of all) was asked for; None before any."""
        where, params = ("", []) if session_id is None else (" AND session_id = ?", [session_id])
        return self._query(f"SELECT MIN(created_at) AS at FROM messages WHERE role = 'assistant'{where}",
                           params)[0]["at"]

    def count_steps(self, session_id: int | None = None) -> int:
        """Steps stored for one session, or for all."""
        if session_id is None:
            return self._query("SELECT COUNT(*) AS n FROM steps")[0]["n"]
        return self._query("SELECT COUNT(*) AS n FROM steps s JOIN messages m ON m.id = s.message_id "
                           "WHERE m.session_id = ?", [session_id])[0]["n"]

    def lab_runs(self, limit: int = 50) -> list[dict]:
        """The newest lab runs first: id, created_at, experiment (not their results)."""
        return self._query("SELECT id, created_at, experiment FROM lab_runs ORDER BY id DESC LIMIT ?", [limit])

    def lab_run(self, run_id: int) -> dict:
        """One lab run with its settings, machine and results decoded."""
        rows = self._query("SELECT * FROM lab_runs WHERE id = ?", [run_id])
        if not rows:
            raise StoreError(f"no lab run with id {run_id}")
        row = rows[0]
        return {**row, **{key: json.loads(row[key]) for key in ("settings", "machine", "results")}}
