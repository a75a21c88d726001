"""HTML pieces of the live phase panel: pure functions of a trace, so they are testable as strings.

Every number shown is measured on the server; the definitions are those of engine/metrics.py. The
words come from the language's catalogue (app/i18n).
"""
from __future__ import annotations

from html import escape

from engine import EngineConfig, ModelInfo, PoolUsage, RequestMetrics

from ..i18n import DEFAULT, t
from .trace import ReplyTrace, held_seconds

FINISH_REASONS = {"eos": "reason.eos", "length": "reason.length", "stop": "reason.stop",
                  "interrupted": "reason.interrupted"}


def _num(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "–" if value is None else f"{value:,.{digits}f}{unit}"


def counted(lang: str, count: int, one: str, many: str, **fields) -> str:
    """The text for a count: key one for 1, key many otherwise (English plurals; Chinese has none)."""
    return t(lang, one if count == 1 else many, n=count, **fields)


def queued_html(num_ahead: int, num_running: int, lang: str = DEFAULT) -> str:
    """A reply the engine has not taken in yet: how many are ahead of it, and why it waits."""
    if num_ahead == 0:
        return f'<div class="ps-phase ps-queued" data-phase="queued">{t(lang, "phase.starting")}</div>'
    return (f'<div class="ps-phase ps-queued" data-phase="queued">'
            f'{counted(lang, num_ahead, "phase.queued_one", "phase.queued_many", running=num_running)}</div>')


WAITING_FOR = {"lab": "phase.waiting_lab", "precision": "phase.waiting_precision"}  # Engine.calling's names
PAUSED_FOR = {"lab": "phase.paused_lab", "precision": "phase.paused_precision"}  # the same, mid-reply
HELD_BY = {"lab": "warning.held_lab", "precision": "warning.held_precision"}  # afterwards (Finished.held_ms)


def waiting_html(measuring: str, lang: str = DEFAULT, started: bool = False) -> str:
    """A reply waiting while a measurement holds the engine (the Lab's or a precision switch's): before it
    started, or (started) paused between two of its tokens."""
    text = t(lang, (PAUSED_FOR if started else WAITING_FOR)[measuring])
    return f'<div class="ps-phase ps-queued" data-phase="queued">{text}</div>'


def _others(num_others: int, num_held: int, lang: str) -> str:
    if num_others <= 0:
        return ""
    held = t(lang, "phase.others_held", n=num_held) if num_held > 0 else ""
    return " · " + counted(lang, num_others, "phase.others_one", "phase.others_many") + held


def phase_html(trace: ReplyTrace | None, num_others: int = 0, lang: str = DEFAULT, num_held: int = 0) -> str:
    """The phase of a reply; num_others: the other requests the engine runs beside it now, of which num_held
    are held step by step (Explain's walk-through: in the batch's count, not in its decode steps)."""
    if trace is None:
        return f'<div class="ps-phase ps-idle">{t(lang, "phase.ready")}</div>'
    phase = trace.phase
    if phase == "queued":
        return queued_html(0, 0, lang)
    if phase == "prefill":
        done = trace.chunks[-1].end if trace.chunks else trace.num_cached_tokens
        total = trace.num_prompt_tokens
        share = 100 * done / total if total else 0
        return (f'<div class="ps-phase ps-prefill" data-phase="prefill">'
                f'{t(lang, "phase.prefill", done=done, total=total)}{_others(num_others, num_held, lang)}'
                f'<div class="ps-bar"><div style="width:{share:.0f}%"></div></div></div>')
    count = len(trace.steps)
    if phase == "decode":
        batch = trace.steps[-1].batch_size
        in_batch = " " + t(lang, "phase.batch", n=batch) if batch > 1 else ""
        return (f'<div class="ps-phase ps-decode" data-phase="decode">{t(lang, "phase.decode", n=count)}'
                f'{_others(num_others, num_held, lang)}{in_batch}</div>')
    reason = trace.finished.reason
    if phase == "stopped":
        return f'<div class="ps-phase ps-stopped" data-phase="stopped">{t(lang, "phase.stopped", n=count)}</div>'
    if phase == "error":
        return (f'<div class="ps-phase ps-error" data-phase="error">'
                f'{t(lang, "phase.error", error=escape(trace.finished.error or ""))}</div>')
    why = t(lang, FINISH_REASONS[reason]) if reason in FINISH_REASONS else escape(reason)
    return f'<div class="ps-phase ps-done" data-phase="done">{t(lang, "phase.done", n=count, why=why)}</div>'


def _tile(key: str, label: str, value: str, phase: str = "", note: str = "") -> str:
    note = f'<div class="ps-note" data-kpi="{key}_note">{note}</div>' if note else ""
    return (f'<div class="ps-tile {phase}" data-kpi="{key}"><div class="ps-label">{label}</div>'
            f'<div class="ps-value">{value}</div>{note}</div>')


def kpi_html(trace: ReplyTrace | None, lang: str = DEFAULT) -> str:
    m = trace.metrics() if trace else None
    last_itl = trace.steps[-1].latency_ms if trace and len(trace.steps) > 1 else None
    kv_tokens, kv_bytes = trace.kv if trace else (0, 0)
    cached = ""
    if trace and trace.started:
        cached = t(lang, "kpi.cached", cached=trace.num_cached_tokens, total=trace.num_prompt_tokens)
    if trace and not trace.cache_visible:  # a remote server's: out of sight
        kv_tile = _tile("kv", t(lang, "kpi.kv_remote"), "–")
    else:
        kv_tile = _tile("kv", t(lang, "kpi.kv", n=kv_tokens), f"{kv_bytes / 1e6:,.2f} MB" if trace else "–")
    tiles = [
        _tile("ttft", "TTFT", _num(m and m.ttft_ms, 0, " ms"), "ps-p"),
        _tile("prefill_tps", t(lang, "kpi.prefill"), _num(m and m.prefill_tokens_per_s, 0, " tok/s"), "ps-p"),
        _tile("prompt_tokens", t(lang, "kpi.prompt_tokens"), _num(trace.num_prompt_tokens if trace else None, 0),
              "ps-p", cached),
        _tile("tpot", "TPOT", _num(m and m.tpot_ms, 1, " ms"), "ps-d"),
        _tile("itl", t(lang, "kpi.itl"), _num(last_itl, 1, " ms"), "ps-d"),
        _tile("decode_tps", t(lang, "kpi.decode"), _num(m and m.decode_tokens_per_s, 1, " tok/s"), "ps-d"),
        _tile("generated_tokens", t(lang, "kpi.generated"), _num(len(trace.steps) if trace else None, 0), "ps-d"),
        kv_tile,
    ]
    return f'<div class="ps-tiles" title="{escape(t(lang, "kpi.definitions"))}">{"".join(tiles)}</div>'


def time_split_html(metrics: RequestMetrics | None, lang: str = DEFAULT) -> str:
    """Prefill vs decode share of the end-to-end time of a reply."""
    if metrics is None or not metrics.e2e_ms or metrics.ttft_ms is None:
        return f'<div class="ps-split ps-empty">{t(lang, "split.empty")}</div>'
    prefill = 100 * metrics.ttft_ms / metrics.e2e_ms
    decode = 100 - prefill
    return (f'<div class="ps-split"><div class="ps-split-bar">'
            f'<div class="ps-p-bg" style="width:{prefill:.1f}%"></div><div class="ps-d-bg" style="width:{decode:.1f}%">'
            f'</div></div><div class="ps-split-legend"><span class="ps-p-fg">■ '
            f'{t(lang, "split.first_token", share=prefill, ms=metrics.ttft_ms)}</span><span class="ps-d-fg">■ '
            f'{t(lang, "split.decode", share=decode, ms=metrics.decode_ms)}</span>'
            f'<span>E2E {metrics.e2e_ms:,.0f} ms</span></div></div>')


def stats_line(metrics: RequestMetrics, reason: str, lang: str = DEFAULT, held_ms: dict | None = None) -> str:
    """The small line under each assistant message; without the prompt's size where it is not known (a remote
    server's reply stopped before the server said it); with held_ms (Finished.held_ms), the wait for a
    measurement that its figures include."""
    parts = [f"TTFT {_num(metrics.ttft_ms, 0)} ms", t(lang, "stats.decode", tps=_num(metrics.decode_tokens_per_s)),
             t(lang, "stats.tokens", n=metrics.num_generated_tokens)]
    if metrics.num_prompt_tokens:
        parts[:0] = [t(lang, "stats.prompt", n=metrics.num_prompt_tokens),
                     t(lang, "stats.cached", n=metrics.num_cached_tokens)]
    if held_s := held_seconds(held_ms):
        parts.append(t(lang, "stats.held", seconds=held_s))
    if reason in ("cancelled", "interrupted"):
        parts.append(t(lang, "stats.stopped" if reason == "cancelled" else "stats.interrupted"))
    return " · ".join(parts)


ATTENTION = '<div class="ps-attention">'


def attention(text: str) -> str:
    """A line that says what a button needs first, or why it did nothing, where the user looks: Gradio 6
    shows no toast (gr.Warning, gr.Error) for an event outside its queue (queue=False)."""
    return f"{ATTENTION}{escape(text)}</div>"


def without_attention(html: str | None) -> str:
    """html as it was before attention lines were added to its end."""
    return (html or "").split(ATTENTION)[0]


def with_attention(html: str | None, text: str) -> str:
    """html with one attention line under it (in place of any it had)."""
    return without_attention(html) + attention(text)


def endpoint_html(endpoint, lang: str = DEFAULT) -> str:
    """The model line of a chat against a remote endpoint: what is measured where."""
    return (f'<div class="ps-model"><b>{escape(endpoint.model or "")}</b> · {escape(endpoint.url)}<br>'
            f'{t(lang, "model.endpoint")}</div>')


def loading_html(lang: str = DEFAULT) -> str:
    """The model line while the model loads behind the served page."""
    return f'<div class="ps-model" data-loading="1">{t(lang, "model.loading")}</div>'


LOAD_STAGES = {"start": "load.start", "import": "load.import", "read": "load.read", "convert": "load.convert",
               "quantize": "load.quantize", "compile": "load.compile", "warm": "load.warm"}  # LoadingEngine.stage


def loading_phase_html(stage: tuple[str, dict, float], lang: str = DEFAULT, waiting: bool = False) -> str:
    """The status line while the model loads behind the page: what the load does now (a first start converts
    the bundled GGUF for about six seconds) and for how long it has loaded; with waiting, that the message sent
    meanwhile is answered once it has loaded."""
    name, params, seconds = stage
    what = t(lang, LOAD_STAGES.get(name, "load.read"), **{key: escape(str(value)) for key, value in params.items()})
    waits = t(lang, "phase.loading_waits") if waiting else ""
    return (f'<div class="ps-phase ps-queued" data-phase="loading">'
            f'{t(lang, "phase.loading", stage=what, seconds=seconds)}{waits}</div>')


def switches_text(config: EngineConfig, lang: str = DEFAULT) -> str:
    """The engine's switches set away from their defaults that change what the page shows (a class comparing
    runs needs to know): no KV cache, a sliding window, speculation, no prefix cache, and the like."""
    changed, switches = config.switches(), []
    if "kv_cache" in changed:
        switches.append(t(lang, "switch.no_kv_cache"))
    if "kv_window" in changed:
        switches.append(t(lang, "switch.window", sinks=config.kv_sinks, window=config.kv_window))
    if "speculative" in changed:
        switches.append(t(lang, "switch.speculative", method=config.speculative, k=config.draft_tokens))
    if "prefix_caching" in changed and config.kv_cache and not config.kv_window:  # else said with those
        switches.append(t(lang, "switch.no_prefix_cache"))
    if "attention" in changed:
        switches.append(t(lang, "switch.attention", attention=config.attention))
    if "split_kv" in changed:
        switches.append(t(lang, "switch.no_split_kv"))
    if "tensor_parallel" in changed:
        switches.append(t(lang, "switch.tensor_parallel", n=config.tensor_parallel))
    if "bind_threads" in changed:
        switches.append(t(lang, "switch.bind_threads"))
    return t(lang, "model.switches", switches="; ".join(switches)) if switches else ""


def model_html(info: ModelInfo, lang: str = DEFAULT, config: EngineConfig | None = None) -> str:
    row = info.kv_bytes_per_token // (2 * info.num_layers * info.num_kv_heads)  # bytes of one head's keys
    weights = info.precision if info.precision == "int8" else info.dtype
    sizes = dict(layers=info.num_layers, kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                 per_token=info.kv_bytes_per_token)
    if row % info.head_dim:  # an int8 cache: each row of keys or values carries its own 4-byte scale
        formula = t(lang, "model.formula_scaled", element=(row - 4) // info.head_dim, **sizes)
    else:
        formula = t(lang, "model.formula", element=row // info.head_dim, **sizes)
    line = t(lang, "model.line", weights=escape(weights), forward=escape(info.model_path),
             decode=escape(info.decode_path), context=info.context_window)
    switches = switches_text(config, lang) if config is not None else ""
    plain = "" if info.chat_template else "<br>" + escape(t(lang, "model.no_template"))
    return (f'<div class="ps-model"><b>{escape(info.name)}</b> · {escape(info.device)} · {line}<br>{formula}'
            f'{"<br>" + escape(switches) if switches else ""}{plain}</div>')


def kv_measured_html(trace: ReplyTrace | None, info: ModelInfo, lang: str = DEFAULT) -> str:
    kv_tokens, kv_bytes = trace.kv if trace else (0, 0)
    if not kv_tokens:
        return ""
    measured = t(lang, "model.kv_measured", bytes=kv_bytes, tokens=kv_tokens, per_token=kv_bytes // kv_tokens,
                 formula=info.kv_bytes_per_token)
    return f'<div class="ps-model" data-kpi="kv_check">{measured}</div>'


def pool_html(usage: PoolUsage, num_running: int, num_waiting: int, lang: str = DEFAULT) -> str:
    """The whole KV pool: held by running requests, kept for prefix reuse, free (vLLM's kv_cache_usage)."""
    if not usage.num_blocks:
        return f'<div class="ps-pool" data-kpi="pool">{t(lang, "pool.none")}</div>'
    mb = usage.bytes_per_block / 1e6
    used, cached = 100 * usage.usage, 100 * usage.num_cached / usage.num_blocks
    free = t(lang, "pool.free", free=usage.num_free * mb, total=usage.capacity_bytes / 1e6)
    held = counted(lang, num_running, "pool.held_one", "pool.held_many", mb=usage.num_used * mb)
    waiting = " · " + t(lang, "pool.waiting", n=num_waiting) if num_waiting else ""
    title = t(lang, "pool.blocks", n=usage.num_blocks, size=usage.block_size)
    share = f'<b data-kpi="pool_usage">{used:.1f}%</b>'
    return (f'<div class="ps-pool" data-kpi="pool" title="{escape(title)}">'
            f'<div class="ps-split-bar"><div class="ps-d-bg" style="width:{used:.1f}%"></div>'
            f'<div class="ps-cached-bg" style="width:{cached:.1f}%"></div></div><div class="ps-split-legend">'
            f'<span>{t(lang, "pool.usage", share=share)}</span>'
            f'<span class="ps-d-fg">■ {held}{waiting}</span><span class="ps-cached-fg">■ '
            f'{t(lang, "pool.cached", mb=usage.num_cached * mb)}</span>'
            f'<span>{free}</span></div></div>')


def switching_html(precision: str, lang: str = DEFAULT) -> str:
    """What the precision note says while the engine switches to precision and measures it."""
    key = "precision.switching_reference" if precision == "fp32" else "precision.switching"
    words = t(lang, key, precision=escape(precision))
    return f'<div class="ps-model" data-kpi="switching">{words}</div>'


def precision_html(report: dict | None, lang: str = DEFAULT) -> str:
    """What the running precision costs in quality and buys in speed, as measured when it was chosen."""
    if not report:
        return f'<div class="ps-model" data-kpi="precision">{t(lang, "precision.hint")}</div>'
    if report["precision"] == "fp32":
        return (f'<div class="ps-model" data-kpi="precision">'
                f'{t(lang, "precision.reference", tps=report["decode_tokens_per_s"])}</div>')
    if "no_reference_gb" in report:  # fp32's weights would not have fit beside these
        measured = t(lang, "precision.no_reference", tps=report["decode_tokens_per_s"], gb=report["no_reference_gb"])
    else:
        measured = t(lang, "precision.measured", agreement=100 * report["top1_agreement"], kl=report["mean_kl_nats"],
                     positions=report["positions"], ratio=report["decode_vs_fp32"],
                     tps=report["decode_tokens_per_s"], fp32_tps=report["fp32_decode_tokens_per_s"])
    return f'<div class="ps-model" data-kpi="precision"><b>{escape(report["precision"])}</b>: {measured}</div>'
