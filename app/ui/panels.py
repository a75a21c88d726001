"""HTML pieces of the live phase panel: pure functions of a trace, so they are testable as strings.

Every number shown is measured on the server; the definitions are those of engine/metrics.py.
"""
from __future__ import annotations

from html import escape

from engine import ModelInfo, PoolUsage, RequestMetrics

from .trace import ReplyTrace

DEFINITIONS = (
    "TTFT: submit → first token. TPOT: (E2E − TTFT) / (tokens − 1). ITL: gap between two successive tokens. "
    "Prefill tok/s: prompt tokens prefilled (cached ones left out) / prefill time. "
    "Definitions as in vLLM's benchmarks."
)


def _num(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "–" if value is None else f"{value:,.{digits}f}{unit}"


def _plural(count: int, word: str, words: str | None = None) -> str:
    return f"{count:,} {word if count == 1 else words or word + 's'}"


def queued_html(num_ahead: int, num_running: int) -> str:
    """A reply the engine has not taken in yet: how many are ahead of it, and why it waits."""
    if num_ahead == 0:
        return '<div class="ps-phase ps-queued" data-phase="queued">Starting…</div>'
    ahead = _plural(num_ahead, "reply", "replies")
    return (f'<div class="ps-phase ps-queued" data-phase="queued"><b>Queued</b> — {ahead} ahead of yours '
            f'({num_running:,} running: the batch or the KV pool is full)</div>')


def _others(num_others: int) -> str:
    return f" · running with {_plural(num_others, 'other')}" if num_others > 0 else ""


def phase_html(trace: ReplyTrace | None, num_others: int = 0) -> str:
    """The phase of a reply; num_others: the other requests the engine runs beside it now."""
    if trace is None:
        return '<div class="ps-phase ps-idle">Ready — send a message to watch prefill and decode.</div>'
    phase = trace.phase
    if phase == "queued":
        return queued_html(0, 0)
    if phase == "prefill":
        done = trace.chunks[-1].end if trace.chunks else trace.num_cached_tokens
        total = trace.num_prompt_tokens
        share = 100 * done / total if total else 0
        return (f'<div class="ps-phase ps-prefill" data-phase="prefill"><b>Prefill</b> — {done:,} / {total:,} '
                f'prompt tokens{_others(num_others)}<div class="ps-bar"><div style="width:{share:.0f}%"></div></div>'
                '</div>')
    count = len(trace.steps)
    if phase == "decode":
        batch = trace.steps[-1].batch_size
        return (f'<div class="ps-phase ps-decode" data-phase="decode"><b>Decode</b> — token {count:,}'
                f'{_others(num_others)}{f" (batch of {batch})" if batch > 1 else ""}</div>')
    reason = trace.finished.reason
    if phase == "stopped":
        return f'<div class="ps-phase ps-stopped" data-phase="stopped"><b>Stopped</b> — {count:,} tokens kept</div>'
    if phase == "error":
        return (f'<div class="ps-phase ps-error" data-phase="error"><b>Error</b> — '
                f'{escape(trace.finished.error or "")}</div>')
    why = {"eos": "the model ended its reply", "length": "max new tokens reached", "stop": "stop string",
           "interrupted": "interrupted: the app closed mid-reply"}
    return (f'<div class="ps-phase ps-done" data-phase="done"><b>Done</b> — {count:,} tokens · '
            f'{why.get(reason, escape(reason))}</div>')


def _tile(key: str, label: str, value: str, phase: str = "", note: str = "") -> str:
    note = f'<div class="ps-note" data-kpi="{key}_note">{note}</div>' if note else ""
    return (f'<div class="ps-tile {phase}" data-kpi="{key}"><div class="ps-label">{label}</div>'
            f'<div class="ps-value">{value}</div>{note}</div>')


def kpi_html(trace: ReplyTrace | None) -> str:
    m = trace.metrics() if trace else None
    last_itl = trace.steps[-1].latency_ms if trace and len(trace.steps) > 1 else None
    kv_tokens, kv_bytes = trace.kv if trace else (0, 0)
    tiles = [
        _tile("ttft", "TTFT", _num(m and m.ttft_ms, 0, " ms"), "ps-p"),
        _tile("prefill_tps", "Prefill", _num(m and m.prefill_tokens_per_s, 0, " tok/s"), "ps-p"),
        _tile("prompt_tokens", "Prompt tokens", _num(trace.num_prompt_tokens if trace else None, 0), "ps-p",
              f"cached {trace.num_cached_tokens:,} / {trace.num_prompt_tokens:,}" if trace and trace.started else ""),
        _tile("tpot", "TPOT", _num(m and m.tpot_ms, 1, " ms"), "ps-d"),
        _tile("itl", "Current ITL", _num(last_itl, 1, " ms"), "ps-d"),
        _tile("decode_tps", "Decode", _num(m and m.decode_tokens_per_s, 1, " tok/s"), "ps-d"),
        _tile("generated_tokens", "Generated", _num(len(trace.steps) if trace else None, 0), "ps-d"),
        _tile("kv", f"KV cache · {kv_tokens:,} tok", f"{kv_bytes / 1e6:,.2f} MB" if trace else "–"),
    ]
    return f'<div class="ps-tiles" title="{escape(DEFINITIONS)}">{"".join(tiles)}</div>'


def time_split_html(metrics: RequestMetrics | None) -> str:
    """Prefill vs decode share of the end-to-end time of a reply."""
    if metrics is None or not metrics.e2e_ms or metrics.ttft_ms is None:
        return '<div class="ps-split ps-empty">Time split appears when a reply has started.</div>'
    prefill = 100 * metrics.ttft_ms / metrics.e2e_ms
    decode = 100 - prefill
    return (f'<div class="ps-split"><div class="ps-split-bar">'
            f'<div class="ps-p-bg" style="width:{prefill:.1f}%"></div><div class="ps-d-bg" style="width:{decode:.1f}%">'
            f'</div></div><div class="ps-split-legend"><span class="ps-p-fg">■ until first token {prefill:.0f}% '
            f'({metrics.ttft_ms:,.0f} ms)</span><span class="ps-d-fg">■ decode {decode:.0f}% '
            f'({metrics.decode_ms:,.0f} ms)</span><span>E2E {metrics.e2e_ms:,.0f} ms</span></div></div>')


def stats_line(metrics: RequestMetrics, reason: str) -> str:
    """The small line under each assistant message."""
    parts = [f"{metrics.num_prompt_tokens:,} prompt tok", f"cached {metrics.num_cached_tokens:,}",
             f"TTFT {_num(metrics.ttft_ms, 0)} ms",
             f"decode {_num(metrics.decode_tokens_per_s)} tok/s", f"{metrics.num_generated_tokens} tok"]
    if reason in ("cancelled", "interrupted"):
        parts.append("stopped" if reason == "cancelled" else "interrupted")
    return " · ".join(parts)


def model_html(info: ModelInfo) -> str:
    element = info.kv_bytes_per_token // (2 * info.num_layers * info.num_kv_heads * info.head_dim)
    weights = info.precision if info.precision == "int8" else info.dtype
    formula = (f"2 × {info.num_layers} layers × {info.num_kv_heads} KV heads × {info.head_dim} head dim × "
               f"{element} B = {info.kv_bytes_per_token:,} B/token")
    return (f'<div class="ps-model"><b>{escape(info.name)}</b> · {escape(info.device)} · weights {escape(weights)} · '
            f'forward: {escape(info.model_path)} · decode: {escape(info.decode_path)} · '
            f'context {info.context_window:,} tokens<br>'
            f'KV cache formula: {formula}</div>')


def kv_measured_html(trace: ReplyTrace | None, info: ModelInfo) -> str:
    kv_tokens, kv_bytes = trace.kv if trace else (0, 0)
    if not kv_tokens:
        return ""
    return (f'<div class="ps-model" data-kpi="kv_check">Measured from the cache tensors: {kv_bytes:,} B for '
            f'{kv_tokens:,} tokens = {kv_bytes // kv_tokens:,} B/token (formula: {info.kv_bytes_per_token:,})</div>')


def pool_html(usage: PoolUsage, num_running: int, num_waiting: int) -> str:
    """The whole KV pool: held by running requests, kept for prefix reuse, free (vLLM's kv_cache_usage)."""
    if not usage.num_blocks:
        return ('<div class="ps-pool" data-kpi="pool">KV cache: one growing cache per request (transformers path; '
                'no pool, no prefix reuse)</div>')
    mb = usage.bytes_per_block / 1e6
    used, cached = 100 * usage.usage, 100 * usage.num_cached / usage.num_blocks
    waiting = f" · {num_waiting:,} waiting" if num_waiting else ""
    return (f'<div class="ps-pool" data-kpi="pool" title="{usage.num_blocks:,} blocks of {usage.block_size} tokens">'
            f'<div class="ps-split-bar"><div class="ps-d-bg" style="width:{used:.1f}%"></div>'
            f'<div class="ps-cached-bg" style="width:{cached:.1f}%"></div></div><div class="ps-split-legend">'
            f'<span>KV pool <b data-kpi="pool_usage">{used:.1f}%</b> in use</span>'
            f'<span class="ps-d-fg">■ {usage.num_used * mb:,.1f} MB held by {_plural(num_running, "request")}'
            f'{waiting}</span><span class="ps-cached-fg">■ {usage.num_cached * mb:,.1f} MB cached prefixes</span>'
            f'<span>{usage.num_free * mb:,.0f} of {usage.capacity_bytes / 1e6:,.0f} MB free</span></div></div>')


def precision_html(report: dict | None) -> str:
    """What the running precision costs in quality and buys in speed, as measured when it was chosen."""
    if not report:
        return ('<div class="ps-model" data-kpi="precision">Switching measures each precision against fp32 '
                'here: top-1 agreement, KL divergence and decode speed.</div>')
    if report["precision"] == "fp32":
        return (f'<div class="ps-model" data-kpi="precision"><b>fp32</b>: the reference · decode '
                f'{report["decode_tokens_per_s"]:,.0f} tok/s (measured just now)</div>')
    return (f'<div class="ps-model" data-kpi="precision"><b>{escape(report["precision"])}</b>: '
            f'{100 * report["top1_agreement"]:.1f}% top-1 agreement with fp32, KL {report["mean_kl_nats"]:.3f} nats '
            f'({report["positions"]} positions) · decode {report["decode_vs_fp32"]:.1f}× fp32 '
            f'({report["decode_tokens_per_s"]:,.0f} vs {report["fp32_decode_tokens_per_s"]:,.0f} tok/s), '
            'measured just now</div>')
