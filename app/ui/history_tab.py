"""The History tab: saved sessions, newest first; open one to continue it, rename, delete, export."""
from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

import gradio as gr

from ..cli import setup_flags
from ..gradio_import import private_folder
from ..i18n import DEFAULT, K, t
from .chat_tab import ChatTab, chat_view, model_line_html, render, settings_shown
from .loading import is_loading
from .panels import attention, counted, with_attention, without_attention
from .trace import held_seconds
from .language import Texts
from ..history.export import FORMATS, to_json, write_export
from ..history.recorder import load_chat, questions
from ..history.store import SessionReplying, Store, StoreError, model_name

if TYPE_CHECKING:  # the engine's machinery imports torch: the page is served before it loads
    from engine import Engine

    from .session import ChatSession

# the chat's key in the history (Store.session_key) as the browser tab keeps it (static/phasescope.js,
# remember); none where the browser refuses the page its storage (a strict privacy setting)
REMEMBERED_CHAT_JS = ("(() => { try { return sessionStorage.getItem('phasescope-chat') || ''; } "
                      "catch (e) { return ''; } })()")
COLUMNS = ["saved.col_id", "saved.col_title", "saved.col_updated", "saved.col_model", "saved.col_turns",
           "saved.col_ttft", "saved.col_tpot"]


def columns(lang: str) -> list[str]:
    return [t(lang, key) for key in COLUMNS]


# The table shows the most recent sessions only: Gradio's page copies a component's whole value at every
# event (a structured clone), and 527 rows cost each sent message 44 ms of the page's CPU (measured) while
# the reply's prefill and first decode steps ran beside it.
SHOWN_SESSIONS = 100


def backend_note(ran: str, endpoint, lang: str = DEFAULT) -> str | None:
    """What a session opened in the chat is told when it ran elsewhere than the chat's backend now: ran is
    its device as saved ("cpu", "endpoint http://…/v1"), endpoint the chat's (None: this machine's engine)."""
    def where(device: str | None) -> str:
        return device.removeprefix("endpoint ") if device else t(lang, "chat.backend_local").lower()
    now = f"endpoint {endpoint.url}" if endpoint is not None else None
    before = ran if ran.startswith("endpoint ") else None
    return None if before == now else t(lang, "saved.goes_on", ran=where(before), now=where(now))


def session_rows(store: Store, search: str = "") -> tuple[list[list], int]:
    """The table's rows (the SHOWN_SESSIONS most recent that match), and how many sessions match."""
    def rounded(value, digits):
        return None if value is None else round(value, digits)

    sessions = store.sessions(search)
    return [[r["id"], r["title"], r["updated_at"][:19].replace("T", " "), model_name(r["model"]), r["turns"],
             rounded(r["mean_ttft_ms"], 0), rounded(r["mean_tpot_ms"], 1)]
            for r in sessions[:SHOWN_SESSIONS]], len(sessions)


def sessions_table(store: Store, search: str, lang: str) -> gr.Dataframe:
    return _table(*session_rows(store, search), lang)


def _table(rows: list[list], total: int, lang: str) -> gr.Dataframe:
    note = t(lang, "saved.recent", shown=len(rows), total=f"{total:,}") if total > len(rows) else None
    return gr.Dataframe(value=rows, headers=columns(lang), label=note or t(lang, "saved.sessions"),
                        show_label=note is not None)  # unshown, the label is what a screen reader names it


SHORT_MESSAGE = 48  # characters of a message where a line shows it (all of it on hover in the turns' table)


def shorten(text: str) -> str:
    return text if len(text) <= SHORT_MESSAGE else text[:SHORT_MESSAGE - 1] + "…"


def _tally(kinds: Iterable[str], key: str, name: str, lang: str, between: str = ", ") -> str:
    """A line under the selection (data-name): each kind of reply with how many there are of it; "" where there
    is none."""
    counts = Counter(kinds)  # in the order they first came
    if not counts:
        return ""
    listed = between.join(f"{kind} ({count})" for kind, count in counts.items())
    return f'<div class="ps-percentiles-note" data-{name}>{escape(t(lang, key, listed=listed))}</div>'


def engines_line(messages: list[dict], lang: str) -> str:
    """How the engine ran the session's replies (their `engine` in the JSON export), with how many of each,
    the switches as the flags that set them: "int8 (3), fp32 --no-kv-cache (1)"; "" where none was recorded
    (remote, or saved before schema 8)."""
    return _tally((" ".join(filter(None, setup_flags(m["engine"]))) for m in messages
                   if m["role"] == "assistant" and m.get("engine")), "saved.engines", "engines", lang)


def asked_with(settings: dict, lang: str) -> str:
    """What a reply was asked with (its `settings`), what leaves a setting off left out: 'system prompt "Be
    brief." · temperature 0.7 · top-p 0.9 · up to 256 new tokens'."""
    said = [t(lang, "saved.asked_system", text=shorten(settings["system"]))] if settings.get("system") else []
    said.append(t(lang, "saved.asked_temperature", value=_number(settings.get("temperature", 0))))
    if settings.get("top_p", 1) < 1:
        said.append(t(lang, "saved.asked_top_p", value=_number(settings["top_p"])))
    if settings.get("top_k"):
        said.append(t(lang, "saved.asked_top_k", value=_number(settings["top_k"])))
    if settings.get("repetition_penalty", 1) != 1:
        said.append(t(lang, "saved.asked_penalty", value=_number(settings["repetition_penalty"])))
    if settings.get("seed") is not None:
        said.append(t(lang, "saved.asked_seed", value=_number(settings["seed"])))
    if "max_new_tokens" in settings:
        said.append(t(lang, "saved.asked_max", value=_number(settings["max_new_tokens"])))
    if settings.get("prefill_chunk"):
        said.append(t(lang, "saved.asked_chunk", value=_number(settings["prefill_chunk"])))
    return " · ".join(said)


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def asked_line(messages: list[dict], lang: str) -> str:
    """What the session's replies were asked with (asked_with), with how many of each; "" where none was saved
    (remote replies too save theirs; those saved before schema 11 none)."""
    return _tally((asked_with(m["settings"], lang) for m in messages if m["role"] == "assistant" and m.get("settings")),
                  "saved.asked", "asked", lang, between="; ")


def percentile_table(summary: dict, lang: str) -> str:
    """p50/p90/p99 of a session's TTFT, TPOT, ITL and E2E, as vLLM's benchmarks report them, from its
    summary in the JSON export ({"replies": n, "ttft_ms": {"p50": ...}, ...})."""
    replies = summary["replies"]
    if not replies:
        return ""

    def cell(value) -> str:
        return "–" if value is None else f"{value:,.1f}"

    names = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E"}
    rows = "".join(f"<tr><th>{names[key]}</th>{''.join(f'<td>{cell(v)}</td>' for v in summary[key].values())}</tr>"
                   for key in names)
    head = "".join(f"<th>{q}</th>" for q in summary["ttft_ms"])
    note = counted(lang, replies, "saved.percentiles_one", "saved.percentiles")
    return (f'<div class="ps-percentiles-note">{escape(note)}</div>'
            f'<table class="ps-percentiles"><tr><th></th>{head}</tr>{rows}</table>')


TURN_COLUMNS = ["saved.turn_col_turn", "saved.turn_col_message", "saved.turn_col_prompt", "saved.turn_col_ttft",
                "saved.turn_col_tpot", "saved.turn_col_decode", "saved.turn_col_tokens"]


def turns_table(messages: list[dict], lang: str) -> str:
    """Turn by turn, the message and reply each turn kept, with the reply's figures (the JSON export's
    messages): a later turn's prompt comes mostly from the prefix cache, and its TTFT shows it. The
    replies a Retry or an edit replaced are counted under it (the percentiles above include them)."""
    asked = questions(messages)
    replies = [m for m in messages if m["role"] == "assistant"]
    kept = [m for m in replies if m["replaced_by"] is None]
    if not kept:
        return ""

    def cell(value, digits: int = 1) -> str:
        return "–" if value is None else f"{value:,.{digits}f}"

    ended = {"cancelled": t(lang, "stats.stopped"), "interrupted": t(lang, "stats.interrupted"), "error": "⚠️"}
    rows = []
    for reply in kept:
        m, text = reply["metrics"] or {}, asked.get(reply["turn"], "")
        prompt = f"{cell(m.get('num_prompt_tokens'), 0)} ({cell(m.get('num_cached_tokens'), 0)})"
        tokens = cell(m.get("num_generated_tokens"), 0)
        if reply.get("finish_reason") in ended:
            tokens += f" · {ended[reply['finish_reason']]}"
        if held_s := held_seconds(reply.get("held_ms")):  # a Lab run held it: its timings include the wait
            said = escape(t(lang, "saved.held_short", seconds=held_s))
            tokens += f' · <span title="{escape(t(lang, "saved.held", seconds=held_s))}">{said}</span>'
        values = [reply["turn"], f'<span title="{escape(text)}">{escape(shorten(text))}</span>', prompt,
                  cell(m.get("ttft_ms")), cell(m.get("tpot_ms")), cell(m.get("decode_tokens_per_s")), tokens]
        rows.append("<tr>" + "".join(f"<td>{value}</td>" for value in values) + "</tr>")
    head = "".join(f"<th>{escape(t(lang, key))}</th>" for key in TURN_COLUMNS)
    note = t(lang, "saved.turns")
    if len(replies) > len(kept):
        note += " " + counted(lang, len(replies) - len(kept), "saved.replaced_one", "saved.replaced")
    return (f'<div class="ps-percentiles-note">{escape(note)}</div>'
            f'<div class="ps-turns-box"><table class="ps-percentiles ps-turns"><tr>{head}</tr>{"".join(rows)}'
            '</table></div>')


def _export_buttons_on(on: bool) -> list[gr.Button]:
    """The selected session's row of export buttons: on while a session is selected."""
    return [gr.Button(interactive=on) for _ in FORMATS]


def export_folder() -> Path:
    """A private folder for the export files the download buttons serve, removed when the process exits
    (Gradio serves copies from its own cache, which the app's delete_cache empties)."""
    return private_folder("phasescope-exports-")


def download_when_written(written, file: gr.DownloadButton) -> None:
    """After `written`, an event that wrote a file into `file` (a hidden DownloadButton), the page clicks
    `file`: a DownloadButton serves a file written before its click, so one written at a click goes through
    it (the History tab's and the Lab's files)."""
    written.then(None, js=f"() => {{ const file = document.querySelector('#{file.elem_id}');"
                          " if (file && !file.disabled) file.click(); }")


def _export_buttons(texts: Texts, label: str, id_prefix: str, interactive: bool) -> list[gr.Button]:
    """A label above a row of one button per export format (beside the buttons, the narrow label broke
    "sessions:" over three lines)."""
    with gr.Column(min_width=300):
        texts(gr.Markdown, value=K(label))
        with gr.Row():
            return [gr.Button(fmt.upper(), size="sm", min_width=80, interactive=interactive,
                              elem_id=f"{id_prefix}-{fmt}") for fmt in FORMATS]


def build(engine: Engine, store: Store, chat: ChatTab, tabs: gr.Tabs, page: gr.Tab, texts: Texts,
          lang: gr.Radio) -> None:
    folder = export_folder()
    selected = gr.State(None)
    with gr.Row():
        search = texts(gr.Textbox, placeholder=K("saved.search"), label=K("saved.search_label"), show_label=False,
                       scale=5, elem_id="ps-history-search")
        refresh = texts(gr.Button, value=K("saved.refresh"), scale=1, elem_id="ps-history-refresh")
    # titles shown to 48 characters (in full where the cell is clicked): an 80-character one widened its
    # column until the figures went off the right. The columns' widths fixed, the date and the model on two
    # lines where they need them: sized to their content, a 48-character title still pushed TTFT and TPOT
    # past the right edge of a 1,024-px window (a class's projector); as shares of the width, a phone's
    # table wrapped every word a letter a line. 908 px in all: a phone's table scrolls, as before.
    table = gr.Dataframe(headers=columns(DEFAULT), value=[], interactive=False, wrap=True,
                         label=t(DEFAULT, "saved.sessions"), show_label=False, max_chars=48,
                         column_widths=["44px", "360px", "110px", "150px", "64px", "90px", "90px"],
                         elem_id="ps-history-table")  # filled when the page loads (on_switch)
    chosen = gr.HTML(t(DEFAULT, "saved.select_hint"), elem_id="ps-history-selected")
    with gr.Row():  # off until a session is selected (acting)
        open_button = texts(gr.Button, value=K("saved.open"), variant="primary", interactive=False,
                            elem_id="ps-history-open")
        title = texts(gr.Textbox, placeholder=K("saved.new_title"), label=K("saved.new_title"), show_label=False,
                      scale=3, elem_id="ps-history-title")
        rename = texts(gr.Button, value=K("saved.rename"), interactive=False, elem_id="ps-history-rename")
        delete = texts(gr.Button, value=K("saved.delete"), variant="stop", interactive=False,
                       elem_id="ps-history-delete")
        acting = [open_button, rename, delete]
        confirm = texts(gr.Button, value=K("saved.confirm"), variant="stop", visible=False,
                        elem_id="ps-history-confirm")

    def acting_on(on: bool) -> list[gr.Button]:
        """Open, Rename and Delete: on while a session is selected."""
        return [gr.Button(interactive=on) for _ in acting]

    with gr.Row():
        one = _export_buttons(texts, "saved.selected_exports", "ps-export", interactive=False)
        every = _export_buttons(texts, "saved.all_exports", "ps-export-all", interactive=True)
    # a file is written when its button is clicked (seconds with a long history; a selection wrote all three
    # of its session's, 14 MB for 15,000 steps, kept until the app ended), then downloaded through this
    # button, which the page clicks (a DownloadButton serves a file written before)
    file = gr.DownloadButton(visible="hidden", elem_id="ps-export-file")

    def table_value(query: str, lang_choice: str) -> gr.Dataframe:
        try:
            return sessions_table(store, query or "", lang_choice)
        except StoreError:  # a damaged database: the table as it was (the line says why, table_and_hint)
            return gr.skip()

    def table_and_hint(query: str, lang_choice: str) -> tuple[gr.Dataframe, str]:
        """The table, and the line under it while no session is selected: what to do, or why the table is
        empty (a database that cannot be read: why, where Gradio showed a bare "Error")."""
        try:
            rows, total = session_rows(store, query or "")
        except StoreError as exc:
            return _table([], 0, lang_choice), attention(t(lang_choice, "error.other", detail=exc))
        if total:
            hint = t(lang_choice, "saved.select_hint")
        elif (query or "").strip():
            hint = t(lang_choice, "saved.no_match", query=escape(query.strip()))
        else:
            hint = t(lang_choice, "saved.none_yet")
        return _table(rows, total, lang_choice), hint

    def listing(query, session_id, lang_choice):
        """The table as the database is now; the line under it too, unless it is about a selected session."""
        table_now, hint = table_and_hint(query, lang_choice)
        return table_now, gr.skip() if session_id is not None else hint

    def export(fmt, session_id, shown, lang_choice):
        """The file of one session (session_id) or all (None) in one format, as the database is now, for the
        page to download; where it cannot be written (a session deleted meanwhile, a history over the export
        limit, a full disk), why, under the selection's line."""
        try:
            path = write_export(store, fmt, folder, session_id, force=True)  # named as the tab names it
        except (ValueError, OSError, StoreError) as exc:  # StoreError: a damaged database
            why = with_attention(shown, t(lang_choice, "error.other", detail=exc))
            return gr.DownloadButton(value=None, interactive=False), why
        return gr.DownloadButton(value=str(path), interactive=True), without_attention(shown)

    def selection(session_id, lang_choice) -> list:
        """The selection's line, as the session is now in the database, and its export buttons (the line
        without its percentiles, and why, where the session is over the export limit or cannot be read)."""
        label = ""
        try:  # StoreError: a damaged database, one SQLite cannot read
            title = escape(str(store.session(session_id)["title"]))
            label = t(lang_choice, "saved.selected", id=session_id, title=title)
            session = to_json(store, session_id)["sessions"][0]
        except (ValueError, StoreError) as exc:
            return [label + attention(t(lang_choice, "error.other", detail=exc)), *_export_buttons_on(False)]
        messages = session["messages"]
        label += (percentile_table(session["summary"], lang_choice) + engines_line(messages, lang_choice)
                  + asked_line(messages, lang_choice) + turns_table(messages, lang_choice))
        return [label, *_export_buttons_on(True)]

    def select(rows, lang_choice, event: gr.SelectData):
        session_id = int(rows.iloc[event.index[0], 0])
        label, *downloads = selection(session_id, lang_choice)
        return [session_id, label, gr.Button(visible=False), *downloads, *acting_on(True)]

    # What a button needs first is said under the selection's line (panels.attention), which stays
    def refused(session_id, shown, lang_choice) -> str | None:
        """The selection's line with why a button does nothing: no session selected, or the selected one
        deleted meanwhile (in another tab); None where the button may go on."""
        if session_id is None:
            return with_attention(shown, t(lang_choice, "saved.select_first"))
        if not store.has_session(session_id):
            return with_attention(shown, t(lang_choice, "saved.gone", id=session_id))
        return None

    def reopened(session_id: int, lang_choice: str, current: ChatSession | None) -> list:
        """The stored session in the chat tab, in current's place: chat.outputs, the model line, which says
        where the session ran where that was elsewhere, and the settings its last reply was asked with.
        StoreError where the database cannot be read."""
        session = load_chat(store, session_id, lang_choice)
        chat.leave(current)  # the chat it replaces: its reply, if one runs, stops drawing over this one
        session.endpoint = current.endpoint if current else None  # it goes on where the model line says
        note = backend_note(store.session(session_id)["device"], session.endpoint, lang_choice)
        trace = session.traces[-1] if session.traces else None
        return [*render(session, engine, trace),
                model_line_html(session, engine, lang_choice) + (attention(note) if note else ""),
                *settings_shown(session.settings)]

    def open_session(session_id, shown, lang_choice, current):
        try:
            if line := refused(session_id, shown, lang_choice):
                return gr.skip(), line, *[gr.skip()] * len(restored)
            return gr.Tabs(selected="chat"), without_attention(shown), *reopened(session_id, lang_choice, current)
        except StoreError as exc:  # a damaged database
            line = with_attention(shown, t(lang_choice, "error.other", detail=exc))
            return gr.skip(), line, *[gr.skip()] * len(restored)

    def do_rename(session_id, new_title, query, shown, lang_choice):
        line = refused(session_id, shown, lang_choice)
        if line is None and not (new_title or "").strip():
            line = with_attention(shown, t(lang_choice, "saved.title_first"))
        if line:
            return gr.skip(), table_value(query, lang_choice), line, *[gr.skip() for _ in FORMATS]
        try:
            store.rename_session(session_id, new_title)
        except StoreError as exc:  # a full disk, a damaged database
            line = with_attention(shown, t(lang_choice, "error.other", detail=exc))
            return gr.skip(), table_value(query, lang_choice), line, *[gr.skip() for _ in FORMATS]
        return "", table_value(query, lang_choice), *selection(session_id, lang_choice)

    def ask_to_delete(session_id, shown, lang_choice):
        if line := refused(session_id, shown, lang_choice):
            return gr.Button(visible=False), line
        return gr.Button(visible=True), without_attention(shown)

    def do_delete(session_id, query, shown, lang_choice):
        try:
            if not (line := refused(session_id, shown, lang_choice)):
                store.delete_session(session_id)
        except SessionReplying:  # in another tab
            line = with_attention(shown, t(lang_choice, "saved.replying", id=session_id))
        except StoreError as exc:
            line = with_attention(shown, t(lang_choice, "error.other", detail=exc))
        if line:
            return [gr.skip(), line, gr.Button(visible=False), table_value(query, lang_choice)] + \
                [gr.skip() for _ in (*FORMATS, *acting)]
        return [None, t(lang_choice, "saved.deleted"), gr.Button(visible=False), table_value(query, lang_choice),
                *_export_buttons_on(False), *acting_on(False)]

    def export_selected(fmt, session_id, shown, lang_choice):
        if line := refused(session_id, shown, lang_choice):
            return gr.DownloadButton(value=None, interactive=False), line
        return export(fmt, session_id, shown, lang_choice)

    for trigger in (search.submit, refresh.click, page.select):
        trigger(listing, [search, selected, lang], [table, chosen], queue=False)
    for fmt, button, all_button in zip(FORMATS, one, every):
        for written in (button.click(functools.partial(export_selected, fmt), [selected, chosen, lang],
                                     [file, chosen], queue=False),
                        all_button.click(functools.partial(export, fmt, None), [chosen, lang], [file, chosen],
                                         queue=False)):
            download_when_written(written, file)
    table.select(select, [table, lang], [selected, chosen, confirm, *one, *acting], queue=False)
    # queued: it reads the model, and while a first start loads it, a request waiting for it held one of the
    # browser's six connections to the app (see Texts.on_switch)
    restored = [*chat.outputs, chat.model_line, *chat.settings]  # what reopened draws
    open_button.click(open_session, [selected, chosen, lang, chat.session], [tabs, chosen, *restored])
    rename.click(do_rename, [selected, title, search, chosen, lang], [title, table, chosen, *one], queue=False)
    delete.click(ask_to_delete, [selected, chosen, lang], [confirm, chosen], queue=False)
    confirm.click(do_delete, [selected, search, chosen, lang], [selected, chosen, confirm, table, *one, *acting],
                  queue=False)

    def redraw(lang_choice, query, session_id):
        """The table, and the selection's line in the new language: the selection stays, with its files."""
        try:
            kept = session_id is not None and store.has_session(session_id)
        except StoreError:  # a damaged database: table_and_hint says so
            kept = False
        if not kept:
            table_now, hint = table_and_hint(query, lang_choice)
            return table_now, None, hint, *_export_buttons_on(False), *acting_on(False)
        return table_value(query, lang_choice), session_id, *selection(session_id, lang_choice), *acting_on(True)

    texts.on_switch(redraw, [search, selected], [table, selected, chosen, *one, *acting])

    def restore(lang_choice, current, remembered):
        """At a page's load, the chat the browser tab showed before it was reloaded (or the browser restored
        it): its key in the history (Store.session_key), which the tab keeps in its sessionStorage
        (static/phasescope.js), not in the browser's localStorage, which every tab shares: a new tab starts a
        new chat. While the model loads only the conversation: the chat tab draws the rest from it once the
        model has loaded."""
        try:
            session_id = store.session_by_key(remembered or "")
            if current is not None or session_id is None:
                return [gr.skip()] * len(restored)
            if is_loading(engine):
                session = load_chat(store, session_id, lang_choice)
                settings = zip(chat.settings, settings_shown(session.settings))
                drawn = {id(chat.chatbot): chat_view(session.display, session), id(chat.session): session,
                         **{id(control): value for control, value in settings}}
                return [drawn.get(id(component), gr.skip()) for component in restored]
            return reopened(session_id, lang_choice, None)
        except StoreError:  # a damaged database: a new chat
            return [gr.skip()] * len(restored)

    remembered = gr.Textbox(visible=False)
    texts.from_browser(remembered, REMEMBERED_CHAT_JS)
    # after the chat tab's redraw (built before), whose values of a new chat this one's replace
    texts.on_switch(restore, [chat.session, remembered], restored)
