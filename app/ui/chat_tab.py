"""The Chat tab: the conversation on the left, the live prefill/decode panel on the right."""
from __future__ import annotations

import itertools
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gradio as gr

from engine import (EngineBusy, Event, ModelError, Request, SamplingParams, Status, model_sampling, sampling_defaults,
                    sampling_origin)

from ..remote import Endpoint
from ..i18n import DEFAULT, K, t
from . import live, panels
from .language import Texts, user_error
from .loading import is_loading, show_loading
from .session import ActiveRequests, ChatSession, RemoteWorker, ReplyWorker
from .trace import ReplyTrace, held_seconds

if TYPE_CHECKING:  # the engine's machinery imports torch: the page is served before it loads
    from engine import Engine

# How often the page is sent what is new (text, points, the live panel's pieces): static/phasescope.js
# applies it in place. The charts redraw every 1-1.5 s there (a redraw is a whole Plotly replot,
# on the cores decode uses).
UPDATE_EVERY_S = 0.25
PLOT_DIV = '<div class="ps-plot"></div>'  # filled by static/phasescope.js with Plotly
_drawn = itertools.count(1)

NUM_OUTPUTS = 9  # ChatTab.outputs
RecorderFactory = Callable[[ChatSession, list[dict], SamplingParams, ReplyTrace], Callable[[Event], None]]


@dataclass
class ChatTab:
    session: gr.State
    chatbot: gr.Chatbot
    message: gr.Textbox
    phase: gr.HTML
    kpis: gr.HTML
    split: gr.HTML
    stream: gr.Textbox  # hidden: the messages of app/ui/live.py, applied by static/phasescope.js
    kv_check: gr.HTML
    pool: gr.HTML
    leave: Callable[[ChatSession | None], None]  # ends the chat's reply, for another chat in its place
    model_line: gr.HTML  # what answers the chat: not among the outputs above, which a reply draws
    settings: list[gr.components.Component]  # the Settings' controls, in SETTINGS' order

    @property
    def outputs(self) -> list[gr.components.Component]:
        return [self.chatbot, self.message, self.phase, self.kpis, self.split, self.stream, self.kv_check,
                self.pool, self.session]


def _phase(engine: Engine, trace: ReplyTrace | None, request: Request | None, lang: str) -> str:
    """The phase line, with where the request stands among the others the engine runs."""
    if getattr(request, "remote", False):  # a remote endpoint's reply: its server's queue is not visible here
        return panels.phase_html(trace, num_others=0, lang=lang)
    running, _ = engine.load()
    measuring = engine.calling in panels.WAITING_FOR  # a measurement holds the engine (Engine.call)
    if measuring and request is not None and request.status in (Status.PREFILLING, Status.DECODING):  # paused
        return panels.waiting_html(engine.calling, lang, started=True)
    if request is not None and request.status == Status.WAITING:
        if measuring:
            return panels.waiting_html(engine.calling, lang)
        place = engine.place_in_line(request)
        return panels.queued_html(running + (place or 0), running, lang)
    is_running = request is not None and not request.is_finished
    return panels.phase_html(trace, num_others=running - 1 if is_running else 0,
                             num_held=engine.num_held() if is_running else 0, lang=lang)


def _pool(engine: Engine, lang: str) -> str:
    return panels.pool_html(engine.kv_usage(), *engine.load(), lang=lang)


def _live_panels(session: ChatSession, engine: Engine, trace: ReplyTrace | None,
                 request: Request | None = None) -> dict[str, str]:
    """The live panel's pieces, by element id: what a streaming reply sends in its stream messages."""
    lang = session.lang
    metrics = trace.metrics() if trace and trace.steps else None
    return {"ps-phase": _phase(engine, trace, request, lang), "ps-kpis": panels.kpi_html(trace, lang),
            "ps-split": panels.time_split_html(metrics, lang),
            "ps-kv-check": "" if session.endpoint else panels.kv_measured_html(trace, engine.info, lang),
            "ps-pool": "" if session.endpoint else _pool(engine, lang)}


def _show_warnings(session: ChatSession) -> None:
    while session.warnings:
        gr.Warning(session.warnings.pop(0))


def render(session: ChatSession, engine: Engine, trace: ReplyTrace | None, chatbot: bool = True) -> tuple:
    """Every output of the tab, for one moment of a chat; chatbot: whether to send the conversation."""
    _show_warnings(session)
    stream = live.reset(trace.events if trace else [], [r.events for r in session.traces], lang=session.lang,
                        chat=session.store_key)
    # a streaming reply's messages set these pieces in the page behind Gradio's back: Gradio redraws a
    # piece only when its value differs from the one it last drew, so each value here is new
    pieces = [f"{html}<!--{next(_drawn)}-->" for html in _live_panels(session, engine, trace).values()]
    phase, kpis, split, kv_check, pool = pieces
    return (chat_view(session.display, session) if chatbot else gr.skip(), gr.skip(), phase, kpis, split, stream,
            kv_check, pool, session)


def _settings(max_new_tokens, temperature, top_p, top_k, seed, repetition_penalty=1.0) -> SamplingParams:
    seed = None if seed in (None, "") or int(seed) < 0 else int(seed)
    return SamplingParams(max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                          top_k=int(top_k), seed=seed, repetition_penalty=float(repetition_penalty))


def _backend_choices(lang: str) -> list[tuple[str, str]]:
    return [(t(lang, "chat.backend_local"), "local"), (t(lang, "chat.backend_endpoint"), "endpoint")]


SETTINGS = ("system", "max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "prefill_chunk")


def settings_shown(saved: dict) -> list:
    """The Settings' values as a reply was asked with them (saved: its messages.settings), for a chat opened
    again to go on as it was; a setting the reply did not save (one from before they were, or a terminal chat's
    prefill chunk) stays as it is."""
    shown = {**saved, "system": saved.get("system") or "", "seed": -1 if saved.get("seed") is None else saved["seed"]}
    return [shown.get(name, gr.skip()) for name in SETTINGS] if saved else [gr.skip()] * len(SETTINGS)


def model_line_html(chat: ChatSession, engine: Engine, lang: str) -> str:
    """What answers this chat: the local model as it runs now, or the chat's remote endpoint."""
    if chat.endpoint:
        return panels.endpoint_html(chat.endpoint, lang)
    return panels.model_html(engine.info, lang, engine.config)


def make_accept(engine: Engine, active: ActiveRequests, streams: live.Streams):
    """The fast first step of sending: show the message and the queue position, clear the box, keep
    the settings for respond, and open the reply's stream (the page follows it once the message shows).
    The model line and the precision selector are drawn again: another tab may have switched the
    precision since this one was drawn, and the reply runs in the engine's."""
    def accept(message, session, lang, *settings):
        session = session or ChatSession()
        session.lang = lang
        text = (message or "").strip()
        if not text or session.pending:  # an empty message does nothing; one reply at a time per chat
            return gr.skip(), gr.skip(), gr.skip(), session, gr.skip(), gr.skip()
        session.accept(text)
        session.settings = dict(zip(SETTINGS, settings))
        streams.open(session.reply_id)
        active.wait(session.id)
        queued = (chat_view(session.display, session), "", panels.queued_html(0, 0, lang), session)
        if is_loading(engine):  # the page's load draws the model line once the model is there
            return *queued, gr.skip(), gr.skip()
        return *queued, model_line_html(session, engine, lang), engine.info.precision

    return accept


def _idle(chat: ChatSession | None) -> bool:
    """No reply asked for yet: the status line says "Ready"."""
    return chat is None or not (chat.pending or chat.traces)


def make_retry(accept):
    """Retry, under the last reply: take back the last exchange and send its message again, with the
    settings as they are now, as accept does (the box's draft stays). The same prompt again: its tokens
    are in the engine's prefix cache, and the new reply's TTFT shows it."""
    def retry(message, session, lang, *settings):
        if session is None or session.pending or not session.display or not session.asked.strip():
            return gr.skip(), gr.skip(), gr.skip(), session, gr.skip(), gr.skip()
        display, _, *rest = accept(session.retract(), session, lang, *settings)
        return display, gr.skip(), *rest

    return retry


def make_edit(accept):
    """A message of the chat edited in place (the pencil under it): the chat goes back to before that
    message and sends the edited text, with the settings as they are now, as accept does (the box's draft
    stays). The conversation before it is in the engine's prefix cache: only the edited message and what
    follows it are prefilled. The pencils are hidden while a reply runs (accept, render); an edit that
    comes then all the same is undone."""
    def edit(edited: gr.EditData, message, session, lang, *settings):
        text = str(edited.value or "").strip()  # as typed (static/phasescope.js gave the box the text, unescaped)
        index = edited.index if isinstance(edited.index, int) else -1
        if (session is None or session.pending or not text or not 0 <= index < len(session.display)
                or session.display[index]["role"] != "user"):
            return chat_view(session.display if session else [], session), gr.skip(), gr.skip(), session, \
                gr.skip(), gr.skip()
        session.cut(index // 2)
        display, _, *rest = accept(text, session, lang, *settings)
        return display, gr.skip(), *rest

    return edit


def chat_view(display: list[dict], session: ChatSession | None) -> gr.Chatbot:
    """The conversation for the Chatbot, its messages editable unless the chat has a message pending."""
    return gr.Chatbot(display, editable=None if session is not None and session.pending else "user")


def make_respond(engine: Engine, active: ActiveRequests, recorder: RecorderFactory | None, streams: live.Streams):
    """The queued second step: run the accepted message, publishing what is new to the reply's stream
    at its first token and then every UPDATE_EVERY_S; the tab is drawn whole when it ends (make_finish).
    Its event has no outputs and its one input is the chat's state: a component an event waits on shows
    a "pending" status, whose timer Gradio redraws every frame (60 a second, taken from decode on a 2-core machine)."""
    def respond(session):
        text = session.take() if session else ""
        if not text:
            return
        try:
            _respond(session, text, **session.settings)
        finally:
            streams.close(session.reply_id)

    def _respond(session, text, system, max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed,
                 prefill_chunk):
        messages = session.prompt(system, text)
        try:
            sampling = _settings(max_new_tokens, temperature, top_p, top_k, seed, repetition_penalty)
            request = None if session.endpoint else engine.new_request(messages, sampling, fit=True,
                                                                        prefill_chunk=int(prefill_chunk or 0))
            if request is not None:
                engine.check_room()  # QueueFull: refused before anything is saved
        except Exception as exc:  # refused (ValueError, QueueFull), or a fault: said in the reply's place
            if not isinstance(exc, (ValueError, EngineBusy)):  # QueueFull is an EngineBusy
                traceback.print_exc()  # a fault is the app's: its trace in the terminal
            active.finish(session.id)
            session.pending = ""
            session.show_error(user_error(session.lang, exc))
            return
        if request is not None:
            session.sent_as(messages, request, engine.prompt_budget(sampling))
            messages = request.messages
        trace = ReplyTrace(turn=len(session.traces) + 1)
        session.traces.append(trace)
        hooks = []
        if recorder:
            try:
                hooks.append(recorder(session, messages, sampling, trace))
            except Exception as exc:  # a full disk or a broken database must not stop the chat
                session.warn(t(session.lang, "warning.not_saved", detail=exc))
        if session.endpoint:  # measured from here: the reply streams from the remote server
            worker = request = RemoteWorker(session.endpoint, messages, sampling, trace, hooks)
        else:
            worker = ReplyWorker(engine, request, trace, hooks)
        active.start(session.id, request)
        updates = live.LiveReply(session.reply_id, session.traces, session.lang, session.store_key)
        streams.on_abandoned(session.reply_id, request.cancel)  # the page went away: stop generating for nobody
        try:
            while worker.is_running:
                worker.wait(UPDATE_EVERY_S)
                _show_warnings(session)
                # only what is new: the conversation with the reply's live span came with accept
                streams.publish(session.reply_id, updates.update(_live_panels(session, engine, trace, request)))
        finally:
            if worker.is_running:  # an error here: the reply ends with it
                request.cancel()
                worker.wait()
            active.finish(session.id, request)
            if worker.error:
                session.warn(t(session.lang, "warning.ended_early", detail=worker.error))
            session.pending = ""
            if not trace.failed:
                session.converse(text, trace)
            for name, held_ms in ((trace.finished and trace.finished.held_ms) or {}).items():
                if name in panels.HELD_BY and (held_s := held_seconds(held_ms)):
                    session.warn(t(session.lang, panels.HELD_BY[name], seconds=held_s))
            _show_warnings(session)  # the reply's last ones (its end not saved, an error): here, in the queue,
            # as toasts; finish draws the tab outside the queue, where Gradio 6 shows none
        session.show_reply(trace)

    return respond


def make_finish(engine: Engine, active: ActiveRequests):
    """After respond: the whole tab, drawn once (the reply as Markdown with its stats line, the panel,
    the figures). Nothing while the chat still has a reply running: respond had nothing to send."""
    def finish(session):
        if session is None or session.pending or active.is_busy(session.id):
            return (gr.skip(),) * NUM_OUTPUTS
        return render(session, engine, session.traces[-1] if session.traces else None)

    return finish


def precisions(engine: Engine) -> list[str]:
    """The precisions the running model can switch to: int8 on the lean path on CPU (the default
    there), the float formats everywhere (fp16 and bf16 run PyTorch ops on CPU: slower, for comparison)."""
    int8 = engine.runner.name == "lean-llama" and engine.loaded.device.type == "cpu"
    return (["int8"] if int8 else []) + ["fp32", "fp16", "bf16"]


def make_switch(engine: Engine, measured: dict):
    """The precision selector: rebuild the running engine's forward in another precision (the weights
    stay loaded), then measure what that costs and buys against fp32 on this machine (kept in
    measured["report"])."""
    def switch(precision, lang):
        if precision == engine.info.precision:  # the page's load sets the selector to it
            yield gr.skip(), gr.skip(), gr.skip()
            return
        yield gr.skip(), gr.skip(), panels.switching_html(precision, lang)
        try:
            engine.call(lambda: engine.switch_precision(precision))
        except (EngineBusy, ModelError, ValueError) as exc:  # ModelError: weights that would not fit
            gr.Warning(user_error(lang, exc))
            yield engine.info.precision, gr.skip(), panels.precision_html(measured["report"], lang)
            return
        from ..bench.extras import precision_report  # the bench's modules import torch

        measured["report"] = engine.call(lambda: precision_report(engine.fp32_weights(), engine.runner),
                                         name="precision")
        model = panels.model_html(engine.info, lang, engine.config)
        yield gr.skip(), model, panels.precision_html(measured["report"], lang)

    return switch


def make_leave(active: ActiveRequests, streams: live.Streams) -> Callable[[ChatSession | None], None]:
    """Another chat takes the tab's place (New chat, a session opened from History): the reply the chat has
    running or waiting is cancelled (saved as stopped), and its stream closed, so that nothing more of it
    is drawn over the other chat."""
    def leave(session: ChatSession | None) -> None:
        if session:
            active.cancel(session.id)
            streams.close(session.reply_id)  # a reply cancelled before it ran never closes its stream

    return leave


def new_chat(engine: Engine, leave: Callable[[ChatSession | None], None]):
    def handler(session, lang):
        leave(session)
        # the backend chosen stays, as the model line says it does (a remote endpoint, or this machine)
        return render(ChatSession(lang=lang, endpoint=session.endpoint if session else None), engine, None)

    return handler


def _model_sampling_note(lang: str, given: dict, origin: str) -> str:
    """Which settings start from the model's own (generation_config.json or GGUF metadata), in its names."""
    settings = ", ".join(f"`{key}={value:g}`" for key, value in given.items())
    origin = t(lang, {"json": "chat.model_sampling_json", "gguf": "chat.model_sampling_gguf"}[origin])
    return t(lang, "chat.model_sampling", settings=settings, origin=origin) if given else ""


def build(engine: Engine, active: ActiveRequests, texts: Texts, lang: gr.Radio, streams: live.Streams,
          recorder: RecorderFactory | None = None) -> ChatTab:
    session = gr.State(None)
    with gr.Row(equal_height=False):
        with gr.Column(scale=5, min_width=360):
            chatbot = texts(gr.Chatbot, show_label=False, height=480, elem_id="ps-chatbot", buttons=["copy"],
                            sanitize_html=True, render_markdown=True, feedback_options=None, editable="user",
                            placeholder=K("chat.welcome"))  # shown while the chat is empty
            with gr.Row():
                message = texts(gr.Textbox, placeholder=K("chat.placeholder"), label=K("chat.message"),
                                show_label=False, scale=6,  # the label: what a screen reader names it
                                elem_id="ps-message", autofocus=True, lines=1, max_lines=8,
                                container=False)  # no panel around it: the hint had 24 px less
                send = texts(gr.Button, value=K("chat.send"), variant="primary", scale=1, min_width=70,
                             elem_id="ps-send")
                stop = texts(gr.Button, value=K("chat.stop"), variant="stop", scale=1, min_width=70,
                             elem_id="ps-stop")
            new = texts(gr.Button, value=K("chat.new"), size="sm", elem_id="ps-new")
            with texts(gr.Accordion, label=K("chat.settings"), open=False, elem_id="ps-settings"):
                system = texts(gr.Textbox, label=K("chat.system"), placeholder=K("chat.system_default"), lines=2,
                           elem_id="ps-system")
                max_new_tokens = texts(gr.Slider, 1, 2048, value=256, step=1, label=K("chat.max_new"),
                                       elem_id="ps-max-new")
                # the model's own (generation_config.json, GGUF metadata) where it sets them, else a chat's: top-p
                # 0.9 and a repetition penalty of 1.1, as Ollama's (engine/config.py: small models fall into loops)
                given, origin = model_sampling(engine.config.model), sampling_origin(engine.config.model)
                start = sampling_defaults(engine.config.model, chat=True, given=given)
                temperature = texts(gr.Slider, 0, max(2, start["temperature"]), value=start["temperature"],
                                    step=0.05, label=K("chat.temperature"), elem_id="ps-temperature")
                top_p = texts(gr.Slider, 0.05, 1, value=start["top_p"], step=0.05, label=K("chat.top_p"),
                              elem_id="ps-top-p")
                top_k = texts(gr.Slider, 0, max(200, start["top_k"]), value=start["top_k"], step=1,
                              label=K("chat.top_k"), elem_id="ps-top-k")
                repetition_penalty = texts(gr.Slider, 1.0, max(2, start["repetition_penalty"]),
                                           value=start["repetition_penalty"], step=0.05,
                                           label=K("chat.repetition_penalty"), elem_id="ps-repetition-penalty")
                model_note = gr.Markdown(_model_sampling_note(DEFAULT, given, origin), visible=bool(given),
                                         elem_id="ps-model-sampling")
                texts.on_switch(lambda lang_choice: _model_sampling_note(lang_choice, given, origin), [],
                                [model_note])
                seed = texts(gr.Number, label=K("chat.seed"), value=-1, precision=0, minimum=-1, elem_id="ps-seed")
                prefill_chunk = texts(gr.Slider, 0, 1024, value=0, step=16, label=K("chat.prefill_chunk"),
                                      elem_id="ps-prefill-chunk")
            with gr.Row():
                # the precisions, the model line and the pool are drawn when the page loads (redraw)
                precision = texts(gr.Dropdown, [], value=None, label=K("chat.precision"), scale=1, min_width=110,
                                  elem_id="ps-precision")
                precision_note = gr.HTML(panels.precision_html(None), elem_id="ps-precision-note")
            model_line = gr.HTML(panels.loading_html(), elem_id="ps-model-line")
            with texts(gr.Accordion, label=K("chat.backend"), open=False, elem_id="ps-backend"):
                backend = gr.Radio(_backend_choices(DEFAULT), value="local", show_label=False,
                                   elem_id="ps-backend-kind")
                endpoint_url = texts(gr.Textbox, label=K("chat.endpoint_url"), placeholder="http://127.0.0.1:8000/v1",
                                     elem_id="ps-endpoint-url")
                with gr.Row():
                    endpoint_model = texts(gr.Textbox, label=K("chat.endpoint_model"),
                                           placeholder=K("chat.endpoint_model_default"), elem_id="ps-endpoint-model")
                    endpoint_key = texts(gr.Textbox, label=K("chat.endpoint_key"), type="password",
                                         elem_id="ps-endpoint-key")
                use_backend = texts(gr.Button, value=K("chat.use_backend"), size="sm", elem_id="ps-use-backend")
        with gr.Column(scale=6, min_width=420):
            phase = gr.HTML(panels.loading_phase_html(engine.stage) if is_loading(engine)
                            else panels.phase_html(None), elem_id="ps-phase")
            kpis = gr.HTML(panels.kpi_html(None), elem_id="ps-kpis")
            split = gr.HTML(panels.time_split_html(None), elem_id="ps-split")
            gr.HTML(PLOT_DIV, elem_id="ps-latency")
            gr.HTML(PLOT_DIV, elem_id="ps-kv")
            stream = gr.Textbox(live.reset([], []), visible="hidden", elem_id="ps-stream")
            kv_check = gr.HTML("", elem_id="ps-kv-check")
            pool = gr.HTML("", elem_id="ps-pool")
    named = dict(system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                 repetition_penalty=repetition_penalty, seed=seed, prefill_chunk=prefill_chunk)
    settings = [named[name] for name in SETTINGS]  # accept zips them with SETTINGS
    tab = ChatTab(session, chatbot, message, phase, kpis, split, stream, kv_check, pool, make_leave(active, streams),
                  model_line, settings)
    stream.change(None, [stream], None, js="(message) => { window.phasescope && window.phasescope.apply(message); }")
    accept, finish = make_accept(engine, active, streams), make_finish(engine, active)
    respond = make_respond(engine, active, recorder, streams)
    # several chats reply at once: the engine batches their decode steps and queues what does not fit
    replies = []
    for trigger, first in ((message.submit, accept), (send.click, accept), (chatbot.retry, make_retry(accept)),
                           (chatbot.edit, make_edit(accept))):
        # accept is instant: no progress overlay (its fade in and out was drawn as decode began)
        accepted = trigger(first, [message, session, lang, *settings], [chatbot, message, phase, session, model_line,
                                                                        precision], queue=False, show_progress="hidden")
        reply = accepted.then(respond, [session], None, concurrency_limit=engine.config.max_running,
                              concurrency_id="engine", show_progress="hidden")
        reply.then(finish, [session], tab.outputs, queue=False, show_progress="hidden")
        replies.append(reply)
    if is_loading(engine):  # the status line says what the load does; a message sent meanwhile waits for it
        def loaded(lang_choice, chat):
            return panels.phase_html(None, lang=lang_choice) if _idle(chat) else gr.skip()  # a reply draws its own

        show_loading(engine, phase, texts, [session], loaded, waiting=lambda chat: not _idle(chat))
    # after a click on Send, the box again, for the next message (as after Enter in it)
    send.click(None, None, None, js="() => { document.querySelector('#ps-message textarea')?.focus(); }")

    def stop_reply(state):
        if state:
            active.cancel(state.id)  # the event has no outputs: whether one was running is not shown

    stop.click(stop_reply, [session], None, queue=False)
    measured = {"report": None}  # the last precision report, for a redraw in another language
    # change: once per pick, by mouse or keys (Gradio 6 sends input twice for a click, and select not for
    # a key); the value the page's load sets, and the one put back after a refusal, come here too, and are
    # the engine's already: no progress shown (Gradio's timer flashed over the model line at every load), the
    # note says what a switch does. Its own concurrency group: Gradio gives a group the lowest limit of its
    # events once each has run, and in the replies' group this one's 1 would have made the chats of every
    # tab reply one at a time
    precision.change(make_switch(engine, measured), [precision, lang], [precision, model_line, precision_note],
                     concurrency_limit=1, concurrency_id="precision", show_progress="hidden")
    # New chat cancels the running request and closes its stream (new_chat), and the reply's events (so
    # that finish does not draw the chat it replaced)
    new.click(new_chat(engine, tab.leave), [session, lang], tab.outputs, cancels=replies)

    def choose_backend(kind, url, model, key, chat, lang_choice):
        """This chat's backend: the local engine, or a remote endpoint checked by listing its models."""
        chat = chat or ChatSession(lang=lang_choice)
        if kind == "local" or not (url or "").strip():
            chat.endpoint = None
            return chat, model_line_html(chat, engine, lang_choice)
        try:
            endpoint = Endpoint(url.strip(), (model or "").strip() or None, (key or "").strip() or None)
            endpoint.resolve_model()
        except ValueError as exc:  # said under the model line: the backend this chat keeps, and why not that one
            return chat, model_line_html(chat, engine, lang_choice) + panels.attention(user_error(lang_choice, exc))
        chat.endpoint = endpoint
        return chat, panels.endpoint_html(endpoint, lang_choice)

    # queued: it asks the endpoint (a dead one answers after its timeout) or reads the model (which a first
    # start loads for ten seconds): a request waiting so holds one of the browser's six connections to the app
    use_backend.click(choose_backend, [backend, endpoint_url, endpoint_model, endpoint_key, session, lang],
                      [session, model_line])

    def redraw(lang_choice, chat):
        """The panels in another language, or on a page's load; the conversation and a streaming reply's text
        stay as they are. While the model loads, only the model line (the status line says what the load does,
        show_loading): the rest once it has loaded."""
        if is_loading(engine):
            return *[gr.skip()] * 6, panels.loading_html(lang_choice), gr.skip(), gr.skip()
        chat = chat or ChatSession()
        chat.lang = lang_choice
        trace = chat.traces[-1] if chat.traces else None
        outputs = render(chat, engine, trace, chatbot=False)
        return (*outputs[2:-1], model_line_html(chat, engine, lang_choice),
                panels.precision_html(measured["report"], lang_choice),
                gr.Dropdown(choices=precisions(engine), value=engine.info.precision))

    texts.on_switch(redraw, [session], [phase, kpis, split, stream, kv_check, pool, model_line, precision_note,
                                        precision], once_loaded=True)
    texts.on_switch(lambda lang_choice, kind: gr.Radio(_backend_choices(lang_choice), value=kind), [backend],
                    [backend])
    return tab
