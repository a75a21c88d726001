"""The History tab: saved sessions, newest first; open one to continue it, rename, delete, export."""
from __future__ import annotations

import tempfile
from html import escape
from pathlib import Path

import gradio as gr

from engine import Engine

from .chat_tab import ChatTab, render
from ..history.export import FORMATS, export_filename, render as render_export
from ..history.recorder import load_chat
from ..history.store import Store, StoreError

COLUMNS = ["id", "title", "updated", "model", "turns", "mean TTFT ms", "mean TPOT ms"]


def session_rows(store: Store, search: str = "") -> list[list]:
    def rounded(value, digits):
        return None if value is None else round(value, digits)

    return [[r["id"], r["title"], r["updated_at"][:19].replace("T", " "), r["model"], r["turns"],
             rounded(r["mean_ttft_ms"], 0), rounded(r["mean_tpot_ms"], 1)] for r in store.sessions(search)]


def write_exports(store: Store, folder: Path, session_id: int | None) -> list[str]:
    """One file per format, named without user text; returns their paths."""
    paths = []
    for fmt in FORMATS:
        path = folder / export_filename(fmt, session_id)
        path.write_text(render_export(store, fmt, session_id), encoding="utf-8", newline="")
        paths.append(str(path))
    return paths


def build(engine: Engine, store: Store, chat: ChatTab, tabs: gr.Tabs) -> None:
    folder = Path(tempfile.mkdtemp(prefix="phasescope-exports-"))
    selected = gr.State(None)
    with gr.Row():
        search = gr.Textbox(placeholder="Search titles and messages…", show_label=False, scale=5,
                            elem_id="ps-history-search")
        refresh = gr.Button("Refresh", scale=1, elem_id="ps-history-refresh")
    table = gr.Dataframe(headers=COLUMNS, value=session_rows(store), interactive=False, wrap=True,
                         elem_id="ps-history-table")
    chosen = gr.HTML("Select a session in the table.", elem_id="ps-history-selected")
    with gr.Row():
        open_button = gr.Button("Open in chat", variant="primary", elem_id="ps-history-open")
        title = gr.Textbox(placeholder="New title", show_label=False, scale=3, elem_id="ps-history-title")
        rename = gr.Button("Rename", elem_id="ps-history-rename")
        delete = gr.Button("Delete", variant="stop", elem_id="ps-history-delete")
        confirm = gr.Button("Really delete?", variant="stop", visible=False, elem_id="ps-history-confirm")
    with gr.Row():
        gr.Markdown("**Selected session:**")
        one = [gr.DownloadButton(f"{fmt.upper()}", size="sm", interactive=False, elem_id=f"ps-export-{fmt}")
               for fmt in FORMATS]
        gr.Markdown("**All sessions:**")
        every = [gr.DownloadButton(f"{fmt.upper()}", size="sm", elem_id=f"ps-export-all-{fmt}") for fmt in FORMATS]

    def listing(query):
        paths = write_exports(store, folder, None)
        return [session_rows(store, query or "")] + [gr.DownloadButton(value=p) for p in paths]

    def select(rows, event: gr.SelectData):
        session_id = int(rows.iloc[event.index[0], 0])
        paths = write_exports(store, folder, session_id)
        label = f"Selected: <b>#{session_id}</b> — {escape(str(rows.iloc[event.index[0], 1]))}"
        return [session_id, label, gr.Button(visible=False)] + [gr.DownloadButton(value=p, interactive=True)
                                                                  for p in paths]

    def open_session(session_id):
        if session_id is None:
            raise gr.Error("Select a session first.")
        session = load_chat(store, session_id)
        trace = session.traces[-1] if session.traces else None
        return (*render(session, engine, trace), gr.Tabs(selected="chat"))

    def do_rename(session_id, new_title, query):
        if session_id is None:
            raise gr.Error("Select a session first.")
        store.rename_session(session_id, new_title)
        return "", session_rows(store, query or "")

    def do_delete(session_id, query):
        try:
            store.delete_session(session_id)
        except StoreError as exc:
            raise gr.Error(str(exc))
        return [None, "Deleted.", gr.Button(visible=False), session_rows(store, query or "")] + \
            [gr.DownloadButton(value=None, interactive=False) for _ in FORMATS]

    listing_outputs = [table, *every]
    for trigger in (search.submit, refresh.click):
        trigger(listing, [search], listing_outputs, queue=False)
    tabs.select(listing, [search], listing_outputs, queue=False)
    table.select(select, [table], [selected, chosen, confirm, *one], queue=False)
    open_button.click(open_session, [selected], [*chat.outputs, tabs], queue=False)
    rename.click(do_rename, [selected, title, search], [title, table], queue=False)
    delete.click(lambda s: gr.Button(visible=s is not None), [selected], [confirm], queue=False)
    confirm.click(do_delete, [selected, search], [selected, chosen, confirm, table, *one], queue=False)
