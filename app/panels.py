"""HTML pieces of the live phase panel: pure functions of a trace, so they are testable as strings.

Every number shown is measured on the server; the definitions are those of engine/metrics.py.
"""
from __future__ import annotations

from html import escape

from engine import ModelInfo, RequestMetrics

from .trace import ReplyTrace

DEFINITIONS = (
    "TTFT: submit → first token. TPOT: (E2E − TTFT) / (tokens − 1). ITL: gap between two successive tokens. "
    "Prefill tok/s: prompt tokens / prefill time. Definitions as in vLLM's benchmarks."
)


def _num(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "–" if value is None else f"{value:,.{digits}f}{unit}"


def queued_html(num_ahead: int) -> str:
    if num_ahead == 0:
        return '<div class="ps-phase ps-queued" data-phase="queued">Starting…</div>'
    replies = "reply" if num_ahead == 1 else "replies"
    return (f'<div class="ps-phase ps-queued" data-phase="queued"><b>Queued</b> — {num_ahead} {replies} ahead '
            'of yours; the engine runs one at a time</div>')


def phase_html(trace: ReplyTrace | None) -> str:
    if trace is None:
        return '<div class="ps-phase ps-idle">Ready — send a message to watch prefill and decode.</div>'
    phase = trace.phase
    if phase == "queued":
        return queued_html(0)
    if phase == "prefill":
        done = trace.chunks[-1].end if trace.chunks else 0
        total = trace.num_prompt_tokens
        share = 100 * done / total if total else 0
        return (f'<div class="ps-phase ps-prefill" data-phase="prefill"><b>Prefill</b> — {done:,} / {total:,} '
                f'prompt tokens<div class="ps-bar"><div style="width:{share:.0f}%"></div></div></div>')
    count = len(trace.steps)
    if phase == "decode":
        return f'<div class="ps-phase ps-decode" data-phase="decode"><b>Decode</b> — token {count:,}</div>'
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


def _tile(key: str, label: str, value: str, phase: str = "") -> str:
    return (f'<div class="ps-tile {phase}" data-kpi="{key}"><div class="ps-label">{label}</div>'
            f'<div class="ps-value">{value}</div></div>')


def kpi_html(trace: ReplyTrace | None) -> str:
    m = trace.metrics() if trace else None
    last_itl = trace.steps[-1].latency_ms if trace and len(trace.steps) > 1 else None
    kv_tokens, kv_bytes = trace.kv if trace else (0, 0)
    tiles = [
        _tile("ttft", "TTFT", _num(m and m.ttft_ms, 0, " ms"), "ps-p"),
        _tile("prefill_tps", "Prefill", _num(m and m.prefill_tokens_per_s, 0, " tok/s"), "ps-p"),
        _tile("prompt_tokens", "Prompt tokens", _num(trace.num_prompt_tokens if trace else None, 0), "ps-p"),
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
    parts = [f"{metrics.num_prompt_tokens:,} prompt tok", f"TTFT {_num(metrics.ttft_ms, 0)} ms",
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
