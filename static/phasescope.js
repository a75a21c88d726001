// PhaseScope's streaming front end. While a reply streams, the server sends only what is new (the reply's
// new text, the charts' new points) through one hidden textbox, #ps-stream; this script applies it in
// place: text is set on the reply's live span (no Markdown re-render of the whole reply), points are
// added with Plotly.extendTraces (no new figure). Whole figures ("reset") come at the start and end of a
// reply, on a new chat and when a saved chat is opened. The message format is app/ui/live.py's.
(() => {
  const CONFIG = {displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"]};
  const CHART_EVERY_MS = 400;  // the most often a chart is redrawn; text goes at once
  const charts = {latency: {queue: null, timer: null}, kv: {queue: null, timer: null}};
  let reply = {id: null, text: ""};

  function chartDiv(name) {
    return document.querySelector(`#ps-${name} .ps-plot`);
  }

  function draw(name, spec) {
    const div = chartDiv(name);
    if (!div || !window.Plotly) return;
    const chart = charts[name];
    chart.queue = null;  // points queued before this figure are in it
    window.Plotly.react(div, spec.data, spec.layout, CONFIG);
  }

  // ext: {trace, points: {x: [...], y: [...], ...}, mode}
  function queuePoints(name, ext) {
    const chart = charts[name];
    if (!chart.queue) {
      chart.queue = {trace: ext.trace, points: {}, mode: ext.mode};
    }
    for (const [key, values] of Object.entries(ext.points)) {
      chart.queue.points[key] = (chart.queue.points[key] || []).concat(values);
    }
    chart.queue.mode = ext.mode;
    if (!chart.timer) chart.timer = setTimeout(() => flush(name), CHART_EVERY_MS);
  }

  function flush(name) {
    const chart = charts[name], queued = chart.queue, div = chartDiv(name);
    chart.timer = null;
    chart.queue = null;
    if (!queued || !div || !window.Plotly || !div.data || !div.data[queued.trace]) return;
    const update = Object.fromEntries(Object.entries(queued.points).map(([key, values]) => [key, [values]]));
    window.Plotly.extendTraces(div, update, [queued.trace]);
    if (queued.mode && div.data[queued.trace].mode !== queued.mode) {
      window.Plotly.restyle(div, {mode: queued.mode}, [queued.trace]);  // markers off on long replies
    }
  }

  function showText() {
    const spans = document.querySelectorAll("#ps-chatbot .ps-live");
    const span = spans[spans.length - 1];
    if (!span || span.textContent === reply.text) return;
    const before = scroller(span);  // none yet: the reply fitted, so the reader is at its end
    const atEnd = !before || before.scrollHeight - before.scrollTop - before.clientHeight < 40;
    span.textContent = reply.text;  // text, never markup
    const box = before || scroller(span);
    if (atEnd && box) box.scrollTop = box.scrollHeight;
  }

  function scroller(element) {
    for (let e = element.parentElement; e; e = e.parentElement) {
      const style = getComputedStyle(e);
      if (/(auto|scroll)/.test(style.overflowY) && e.scrollHeight > e.clientHeight) return e;
    }
    return null;
  }

  function apply(raw) {
    if (!raw) return;
    let message;
    try {
      message = JSON.parse(raw);
    } catch (error) {
      return;
    }
    if (message.reply !== undefined && message.reply !== reply.id) reply = {id: message.reply, text: ""};
    if (message.text) {
      reply.text += message.text;
      showText();
    }
    for (const name of ["latency", "kv"]) {
      if (message.reset && message.reset[name]) draw(name, message.reset[name]);
      if (message.append && message.append[name]) queuePoints(name, message.append[name]);
    }
  }

  // the figures the page starts with: the stream box's first value (a change event only follows updates);
  // called on load, it waits for the page and plotly.js, which Gradio may add after its own scripts
  function start() {
    const box = document.querySelector("#ps-stream textarea");
    if (!box || !window.Plotly || !chartDiv("latency")) {
      setTimeout(start, 100);
      return;
    }
    if (box.value) apply(box.value);
    // a live span drawn after its text arrived (the chatbot renders asynchronously)
    new MutationObserver(() => { if (reply.text) showText(); })
      .observe(document.querySelector("#ps-chatbot") || document.body, {childList: true, subtree: true});
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
