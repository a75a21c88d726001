"""The metric definitions of shared/REFERENCE.md, on hand-made timestamps."""
from __future__ import annotations

import pytest

from engine.metrics import e2e_ms, itl_ms, per_second, percentile, request_metrics, session_summary, tpot_ms, ttft_ms

MS = 1_000_000
TOKENS = [100 * MS, 130 * MS, 150 * MS, 190 * MS]  # submit at 0


def test_ttft_itl_tpot_e2e():
    assert 100.0 == ttft_ms(0, TOKENS)
    assert [30.0, 20.0, 40.0] == itl_ms(TOKENS)
    assert 190.0 == e2e_ms(0, TOKENS)
    assert 30.0 == tpot_ms(0, TOKENS)  # (190 - 100) / (4 - 1)


def test_tpot_needs_two_tokens():
    assert (None, None) == (tpot_ms(0, TOKENS[:1]), tpot_ms(0, []))


@pytest.mark.parametrize("q, expected", [(0, 1.0), (50, 3.0), (90, 4.6), (99, 4.96), (100, 5.0)])
def test_percentiles_interpolate_like_numpy(q, expected):
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], q) == pytest.approx(expected)


def test_request_metrics():
    m = request_metrics(submit_ns=0, token_ns=TOKENS, end_ns=200 * MS, prefill_ms=80.0, num_prompt_tokens=40,
                        num_cached_tokens=0, kv_tokens=43, kv_bytes=43 * 10)
    assert (100.0, 30.0, 190.0, 90.0) == (m.ttft_ms, m.tpot_ms, m.e2e_ms, m.decode_ms)
    assert m.prefill_tokens_per_s == pytest.approx(500.0)  # 40 tokens in 80 ms
    assert m.decode_tokens_per_s == pytest.approx(1000 / 30)
    assert m.throughput_tokens_per_s == pytest.approx(4000 / 190)
    assert {"p50": 30.0, "p90": pytest.approx(38.0), "p99": pytest.approx(39.8)} == m.itl_percentiles_ms


def test_no_tokens_is_not_a_division_by_zero():
    m = request_metrics(submit_ns=0, token_ns=[], end_ns=5 * MS, prefill_ms=0.0, num_prompt_tokens=3,
                        num_cached_tokens=0, kv_tokens=0, kv_bytes=0)
    assert (None, None, 5.0, None) == (m.ttft_ms, m.tpot_ms, m.e2e_ms, m.decode_tokens_per_s)
    assert per_second(0, 10.0) is None


def test_session_summary_over_requests():
    a = request_metrics(submit_ns=0, token_ns=TOKENS, end_ns=190 * MS, prefill_ms=1, num_prompt_tokens=1,
                        num_cached_tokens=0, kv_tokens=0, kv_bytes=0)
    summary = session_summary([a, a])
    assert 100.0 == summary["ttft_ms"]["p50"]
    assert 30.0 == summary["tpot_ms"]["p99"]
