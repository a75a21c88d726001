// PhaseScope's streaming front end. While a reply streams, the server sends only what is new (the reply's
// new text, the charts' new points, the live panel's changed pieces) in a stream of its own that the
// reply's live span names (follow); this script applies it in place: the text so far is drawn on the live
// span as Markdown by static/markdown.js (not by Gradio, which would draw the whole conversation again),
// points are added to the drawn figure (no new figure: see flush), the panel's pieces replace what Gradio
// drew in their boxes. Whole figures ("reset") come at the start of a reply, and through the hidden
// textbox #ps-stream at its end, on a new chat and when a saved chat is opened. The message format is
// app/ui/live.py's.
(() => {
  // showSendToCloud: plotly.js 3's "Share chart..." button would upload the figure to Plotly Cloud
  const CONFIG = {displaylogo: false, showSendToCloud: false, responsive: true,
                  modeBarButtonsToRemove: ["select2d", "lasso2d"]};
  // While a reply streams, a chart is redrawn at most every CHART_EVERY_MS, and less often when its
  // redraws are slow: Plotly.extendTraces replots a whole figure for a few new points (10-25 ms of a
  // 2-core machine's CPU each, 30-50 ms the first time, taken from the decode it shows), so that a
  // chart's redraws take at most CHART_SHARE of the time, waiting no longer than CHART_LATEST_MS. A
  // reply shorter than a second is drawn whole when it ends. Text goes at once.
  const CHART_EVERY_MS = 1000;
  const CHART_LATEST_MS = 1500;
  const CHART_SHARE = 0.03;
  const charts = {latency: {queue: null, timer: null, cost: 0}, kv: {queue: null, timer: null, cost: 0}};

  function timed(chart, redraw) {
    const start = performance.now();
    redraw();
    chart.cost = performance.now() - start;
  }

  function delay(chart) {
    return Math.min(CHART_LATEST_MS, Math.max(CHART_EVERY_MS, chart.cost * (1 / CHART_SHARE - 1)));
  }
  let reply = {id: null, text: ""};
  const markdown = window.phasescopeMarkdown;  // static/markdown.js, loaded before this script
  // plotly.js is loaded once the page is up (loadPlotly), not with it: evaluated among Gradio's scripts, its
  // 4.5 MB held the page's controls back (app/main.py, launch_options); loaded when the first figure comes
  // (with the load's answer, after the model line it draws) or PLOTLY_LATEST_MS after the page is up.
  // Messages that come before it wait.
  const PLOTLY_SRC = document.currentScript ? document.currentScript.dataset.plotly : null;
  const PLOTLY_LATEST_MS = 1500;
  const early = [];
  let plotlyAsked = false;

  function chartDiv(name) {
    return document.querySelector(`#ps-${name} .ps-plot`);
  }

  // On a phone's width the legend, at the right above the plot, reached the title at the left ("KV 缓存大小"
  // under "已分配"): below NARROW_PX the title takes the top line, and the legend's rows (one to four, as
  // its entries wrap) the room between it and the plot, the top margin grown to hold them once drawn.
  const NARROW_PX = 520;
  const TITLE_PX = 30;
  function fitted(layout, div) {
    if (div.clientWidth >= NARROW_PX || !layout.title || !layout.margin || !layout.height) return layout;
    return {...layout, margin: {...layout.margin, t: 96},
            title: {...layout.title, yref: "container", y: 1 - 6 / layout.height, yanchor: "top"}};
  }

  function fitLegend(div) {
    const legend = div.querySelector(".legend");
    if (div.clientWidth >= NARROW_PX || !legend || !div.layout.margin) return;
    const needed = Math.ceil(TITLE_PX + legend.getBBox().height + 8);
    if (needed > div.layout.margin.t) window.Plotly.relayout(div, {"margin.t": needed});
  }

  function draw(name, spec) {
    const div = chartDiv(name);
    if (!div || !window.Plotly) return;
    const chart = charts[name];
    chart.queue = null;  // points queued before this figure are in it
    fitToWidth.observe(div);
    if (!div.clientWidth) {  // its tab is hidden: drawn when it shows, with the points that come meanwhile
      chart.spec = spec;
      return;
    }
    chart.spec = null;
    timed(chart, () => {
      window.Plotly.react(div, spec.data, fitted(spec.layout, div), CONFIG);
      fitLegend(div);
    });
  }

  // plotly.js measures a figure's width at its first drawing only, and in a hidden tab (figures drawn again
  // in another language while another tab shows, or at the page's load) it measures nothing: the figure
  // stayed 700 px wide, over its column's edge, and fitted() laid it out for a phone. So the chat's figures
  // wait for their tab to show, and every drawn figure, Gradio's too (Explain, Lab), follows its box's
  // width when it shows (as responsive does the window's, which may change while a tab is hidden).
  const fitToWidth = new ResizeObserver((entries) => {
    for (const {target} of entries) {
      const name = Object.keys(charts).find((n) => chartDiv(n) === target), chart = charts[name];
      if (!target.clientWidth) continue;
      if (chart && chart.spec && !chart.timer) draw(name, chart.spec);
      else if (window.Plotly && target._fullLayout && Math.round(target._fullLayout.width) !== target.clientWidth) {
        window.Plotly.Plots.resize(target);
      }
    }
  });

  // Gradio's figures (a new one at each update) are watched from the click that shows their tab
  function watchFigures(event) {
    if (!(event.target instanceof Element && event.target.closest("[role=tab]"))) return;
    for (const figure of document.querySelectorAll(".js-plotly-plot")) fitToWidth.observe(figure);
  }
  document.addEventListener("click", watchFigures, true);
  document.addEventListener("keyup", watchFigures, true);

  function schedule(name) {
    const chart = charts[name];
    if (!chart.timer) chart.timer = setTimeout(() => flush(name), delay(chart));
  }

  // a whole figure that comes while a reply streams waits its turn like new points
  function queueFigure(name, spec) {
    charts[name].spec = spec;
    charts[name].queue = null;  // in the figure
    schedule(name);
  }

  // a trace's values under a Plotly attribute ("x", "marker.color"), and the same with new ones added at
  // the end, set in `into` (the trace itself, or an update of it)
  function valuesOf(trace, key) {
    return key.split(".").reduce((holder, part) => (holder || {})[part], trace) || [];
  }

  function setExtended(into, trace, key, values) {
    const path = key.split("."), last = path.pop();
    let target = into;
    for (const part of path) target = target[part] = target[part] || {};
    target[last] = valuesOf(trace, key).concat(values);
  }

  // ext's points added to a figure not yet drawn, as Plotly.extendTraces adds them to a drawn one (the level
  // lines to its last point)
  function extendSpec(spec, ext) {
    const trace = spec.data[ext.trace];
    if (!trace) return;
    for (const [key, values] of Object.entries(ext.points)) setExtended(trace, trace, key, values);
    if (ext.mode) trace.mode = ext.mode;
    if (ext.points.x && ext.points.x.length) levelsTo(spec.data, Math.max(...ext.points.x));
  }

  // ext: {trace, points: {x: [...], y: [...], ...}, mode}
  function queuePoints(name, ext) {
    const chart = charts[name];
    if (chart.spec) {
      extendSpec(chart.spec, ext);
      return;
    }
    if (!chart.queue) {
      chart.queue = {trace: ext.trace, points: {}, mode: ext.mode};
    }
    for (const [key, values] of Object.entries(ext.points)) {
      chart.queue.points[key] = (chart.queue.points[key] || []).concat(values);
    }
    chart.queue.mode = ext.mode;
    schedule(name);
  }

  function flush(name) {
    const chart = charts[name], queued = chart.queue, div = chartDiv(name);
    chart.timer = null;
    if (chart.spec) {
      draw(name, chart.spec);
      return;
    }
    chart.queue = null;
    if (!queued || !div || !window.Plotly || !div.data || !div.data[queued.trace]) return;
    const trace = div.data[queued.trace];
    if (queued.mode === trace.mode && inRange(div, queued.points)) {
      timed(chart, () => movePoints(div, queued));
      return;
    }
    const update = Object.fromEntries(Object.entries(queued.points).map(([key, values]) => [key, [values]]));
    widenX(div, queued.points.x);
    if (div.layout.xaxis && div.layout.xaxis.range) levelsTo(div.data, div.layout.xaxis.range[1]);
    // markers off on long replies: set on the trace, drawn by extendTraces' replot (a restyle after it
    // replotted the figure a second time, 17 ms)
    if (queued.mode) trace.mode = queued.mode;
    timed(chart, () => window.Plotly.extendTraces(div, update, [queued.trace]));
  }

  // Whether points fall inside the axes as drawn: then only the trace moves (Plotly.animate without a
  // redraw: 9 ms against extendTraces' 25 for a whole replot, in a quiet page); else extendTraces replots.
  function inRange(div, points) {
    const layout = div._fullLayout;
    if (!layout || !layout.xaxis || !layout.yaxis) return false;
    const inside = (axis, values) => values.every((v) => {
      const log = axis.type === "log", [lo, hi] = axis.range;  // a log axis's range is in powers of ten
      const at = log ? Math.log10(v) : v;  // v <= 0 on a log axis: -Infinity or NaN, outside
      return at >= Math.min(lo, hi) && at <= Math.max(lo, hi);
    });
    return inside(layout.xaxis, points.x || []) && inside(layout.yaxis, points.y || []);
  }

  function movePoints(div, queued) {
    const trace = div.data[queued.trace], frame = {};
    for (const [key, values] of Object.entries(queued.points)) setExtended(frame, trace, key, values);
    const now = {mode: "immediate", transition: {duration: 0}, frame: {duration: 0, redraw: false}};
    window.Plotly.animate(div, {data: [frame], traces: [queued.trace]}, now);
  }

  // While a reply streams, the x axis runs ahead of its points (twice as far as they go), so that the next
  // seconds' points fit without a replot; the reply's whole figure at its end has the axis fitted.
  function widenX(div, xs) {
    if (!xs || !xs.length || !div.layout || !div._fullLayout) return;
    const [lo] = div._fullLayout.xaxis.range, hi = Math.max(...xs);
    div.layout.xaxis = {...div.layout.xaxis, autorange: false, range: [lo, hi + Math.max(16, hi - lo)]};
  }

  // The streaming turn's level lines in the KV chart (allocated, kept: app/ui/charts.py's LEVEL) reach its
  // last point, or the widened axis's end: they stopped where the reply began, as if nothing were allocated
  // after
  function levelsTo(data, x) {
    for (const trace of data) {
      if (trace.meta === "level" && trace.x && trace.x.length === 2 && x > trace.x[1]) trace.x = [trace.x[0], x];
    }
  }

  // the reply's text so far on its own live span, as Markdown (static/markdown.js: its markup escaped,
  // shown as text), kept scrolled to its end if the reader was there; not while the reader has text of it
  // selected (drawn again, the selection would go): the text catches up at the first update after. Only
  // its own: the next reply's span, drawn before that reply's first message, stays empty meanwhile.
  const drawn = new WeakMap();  // live span -> the text drawn on it

  function showText() {
    if (!reply.id) return;
    const spans = document.querySelectorAll(`#ps-chatbot .ps-reply-${CSS.escape(reply.id)}`);
    const span = spans[spans.length - 1];
    if (!span || drawn.get(span) === reply.text || selectedIn(span)) return;
    const before = scroller(span);  // none yet: the reply fitted, so the reader is at its end
    const atEnd = !before || before.scrollHeight - before.scrollTop - before.clientHeight < 40;
    try {
      span.innerHTML = markdown.render(reply.text);
    } catch (error) {  // never expected (static/markdown.js is tested on replies made to break it): text
      span.textContent = reply.text;
    }
    drawn.set(span, reply.text);
    const box = before || scroller(span);
    if (atEnd && box) box.scrollTop = box.scrollHeight;
  }

  function selectedIn(element) {
    const selection = window.getSelection();
    return Boolean(selection && !selection.isCollapsed && element.contains(selection.anchorNode));
  }

  function scroller(element) {
    for (let e = element.parentElement; e; e = e.parentElement) {
      const style = getComputedStyle(e);
      if (/(auto|scroll)/.test(style.overflowY) && e.scrollHeight > e.clientHeight) return e;
    }
    return null;
  }

  // the chat's key in the history (its id and creation time), kept for this browser tab (a new tab starts a
  // new chat): a reload shows the chat again (app/ui/history_tab.py, restore)
  function remember(chat) {
    try {
      if (chat) sessionStorage.setItem("phasescope-chat", String(chat));
      else sessionStorage.removeItem("phasescope-chat");
    } catch (error) {
      // the browser refuses the page its storage: a reload starts a new chat
    }
  }

  function apply(raw) {
    let message;
    try {
      message = JSON.parse(raw);
    } catch (error) {
      return;
    }
    if (!message) return;
    // a message of no reply (figures redrawn in another language) leaves a streaming reply's text as it is
    if (message.reply && message.reply !== reply.id) reply = {id: message.reply, text: ""};
    if ("chat" in message) remember(message.chat);
    if (message.text) {
      reply.text += message.text;
      showText();
    }
    for (const [id, html] of Object.entries(message.panels || {})) {
      const box = document.querySelector(`#${id} .html-container > div`);  // what Gradio's gr.HTML draws in
      if (box) box.innerHTML = html;  // the server's own markup (app/ui/panels.py), its text escaped there
    }
    if (!(message.reset || message.append)) return;
    if (window.Plotly) figures(message);
    else {  // drawn once plotly.js has loaded; the text goes on meanwhile
      early.push(message);
      loadPlotly();
    }
  }

  function figures(message) {
    for (const name of ["latency", "kv"]) {
      // a streaming reply's figures (it has an id) wait their turn; the others are drawn at once
      if (message.reset && message.reset[name]) {
        if (message.reply) queueFigure(name, message.reset[name]);
        else draw(name, message.reset[name]);
      }
      if (message.append && message.append[name]) queuePoints(name, message.append[name]);
    }
  }

  // A streaming reply's messages, one JSON object per line, from the app's own route (app/ui/live.py,
  // Streams), which the live span of the reply names. It ends with the reply; Gradio then draws the
  // whole tab. Relative to the page's address: under `serve --ui` the page and the route are under /ui/.
  const followed = new Set();

  async function follow(replyId) {
    if (!replyId || followed.has(replyId)) return;
    followed.add(replyId);
    try {
      const response = await fetch(`phasescope/live/${encodeURIComponent(replyId)}`, {cache: "no-store"});
      if (!response.ok || !response.body) return;  // ended already
      const reader = response.body.getReader(), decoder = new TextDecoder();
      let pending = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) return;
        pending += decoder.decode(value, {stream: true});
        let end;
        while ((end = pending.indexOf("\n")) >= 0) {
          apply(pending.slice(0, end));
          pending = pending.slice(end + 1);
        }
      }
    } catch (error) {
      // the server went away: the page shows what it had
    }
  }

  // while the chat has a reply running (its live span is there), Send shows as unavailable (a message sent
  // then stays in the box: a chat answers one at a time), and Stop while none runs (app.css)
  function showReplying() {
    document.body.classList.toggle("ps-replying", Boolean(document.querySelector("#ps-chatbot .ps-live")));
  }

  function followLive() {
    for (const span of document.querySelectorAll("#ps-chatbot .ps-live")) {
      const named = span.className.match(/\bps-reply-([\w-]+)/);  // app/ui/session.py's live_span
      if (named) follow(named[1]);
    }
  }

  // A message of yours being edited (its pencil): Gradio's edit box starts from the message as the chat
  // holds it, its markup outside code escaped to be shown as text (app/ui/markdown.py's as_text: "3 &lt; 5",
  // code as typed); the box gets the text itself, and the edit sends it as it reads (app/ui/chat_tab.py's
  // make_edit).
  function textInEditBoxes() {
    for (const box of document.querySelectorAll("#ps-chatbot textarea:not([data-ps-text])")) {
      box.dataset.psText = "1";
      const text = markdown.unescapeOutsideCode(box.value);
      if (text !== box.value) {
        box.value = text;
        box.dispatchEvent(new Event("input", {bubbles: true}));  // into the value Gradio sends
      }
    }
  }

  // Copy message (a button under each message) copies the message as the chat holds it: its markup outside
  // code escaped (as_text) and, under a reply, its stats line's markup, or while the reply streams its live
  // span. The clipboard gets the message as written instead (a streaming reply: its text so far). Code
  // blocks' own copy buttons, which copy the code itself, are left alone.
  const STATS_LINE = /\n\n<span class="ps-stats">[^<]*<\/span>$/;
  const LIVE_SPAN = /^<span class="ps-live ps-reply-([\w-]+)"><\/span>$/;
  let messageButtonAt = -Infinity;  // when a button under a message was last clicked (any other click: never)

  function asWritten(copied) {
    const fromMessage = performance.now() - messageButtonAt < 1000;
    messageButtonAt = -Infinity;
    if (!fromMessage) return null;
    const live = copied.match(LIVE_SPAN);
    if (live) return live[1] === reply.id ? reply.text : "";
    return markdown.unescapeOutsideCode(copied.replace(STATS_LINE, ""));
  }

  document.addEventListener("click", (event) => {
    const button = event.target instanceof Element && event.target.closest("#ps-chatbot .message-buttons button");
    messageButtonAt = button ? performance.now() : -Infinity;
  }, true);
  if (navigator.clipboard && navigator.clipboard.writeText) {
    const write = navigator.clipboard.writeText.bind(navigator.clipboard);
    navigator.clipboard.writeText = (text) => write(asWritten(String(text)) ?? text);
  }
  // where the page is not a secure context (served on a network address over http), Gradio copies from a
  // text box it selects, with the browser's copy command
  document.addEventListener("copy", (event) => {
    const box = event.target;
    const text = box instanceof HTMLTextAreaElement && event.clipboardData ? asWritten(box.value) : null;
    if (text === null) return;
    event.clipboardData.setData("text/plain", text);
    event.preventDefault();
  }, true);

  function loadPlotly() {
    if (plotlyAsked) return;
    plotlyAsked = true;
    if (window.Plotly || !PLOTLY_SRC) {
      drawEarly();
      return;
    }
    const script = document.createElement("script");
    script.src = PLOTLY_SRC;
    script.onload = drawEarly;
    document.head.appendChild(script);
  }

  // once plotly.js is there: the figures the page starts with, the stream box's first value (a change event
  // only follows updates) unless a change came meanwhile, and those of the messages that came before, in order
  function drawEarly() {
    const box = document.querySelector("#ps-stream textarea");
    const pending = early.splice(0);
    let first = null;
    try {
      first = box && JSON.parse(box.value);
    } catch (error) {
      // empty
    }
    if (first && !pending.some((message) => message.seq === first.seq)) figures(first);
    pending.forEach(figures);
  }

  // called on load, it waits for the page
  function start() {
    const box = document.querySelector("#ps-stream textarea");
    if (!box || !chartDiv("latency")) {
      setTimeout(start, 100);
      return;
    }
    if (window.phasescopeFrames) window.phasescopeFrames.stopLeaked();  // before the first figure (frames.js)
    setTimeout(loadPlotly, PLOTLY_LATEST_MS);
    // a new reply's live span: follow its stream; a live span drawn after its text arrived (the chatbot
    // renders asynchronously): fill it
    new MutationObserver(() => {
      showReplying();
      followLive();
      if (reply.text) showText();
      textInEditBoxes();
    }).observe(document.querySelector("#ps-chatbot") || document.body, {childList: true, subtree: true});
  }

  // the Explain tab from the keyboard, for a presenter: → next token, space run / pause (not while typing)
  document.addEventListener("keydown", (event) => {
    const typing = /^(INPUT|TEXTAREA|SELECT|BUTTON)$/.test(document.activeElement?.tagName || "");
    const next = document.querySelector("#ps-explain-next");
    if (typing || !next || next.offsetParent === null) return;  // another tab is shown
    let button = null;
    if (event.key === "ArrowRight") button = next;
    if (event.key === " ") {
      const state = document.querySelector("#ps-explain-steps .ps-explain")?.dataset.explain;
      button = document.querySelector(state === "running" ? "#ps-explain-pause" : "#ps-explain-run");
    }
    if (button) {
      event.preventDefault();
      button.click();
    }
  });

  window.phasescope = {apply, start};
})();
