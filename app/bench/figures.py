"""The bench's headline figures, one line each, read from one run's report: what each issue's targets ask
for (the goal in brackets), so that a run says in a table what it measured against them instead of in
the raw summary lines below it, each number that misses its goal in bold. A figure whose measurement the
run did not make (--quick sizes, a mode or llama-bench left out) is left out."""
from __future__ import annotations

from collections.abc import Callable

FP32, INT8 = "lean-llama fp32", "lean-llama int8"


def _row(report: dict, engine: str, mode: str | None, test: str) -> float:
    """A result's tokens/s: engine, mode (None: any of the engine's, as llama.cpp's one) and test."""
    return next(r.mean for r in report["results"] if r.engine == engine and r.test == test
                and (mode is None or r.mode == mode))


def _both(summary_part: dict, show: Callable[[dict], str], sep: str = " / ") -> str:
    """fp32's figure, sep, int8's; or the one of them the run measured."""
    shown = [show(summary_part[mode]) for mode in (FP32, INT8) if mode in summary_part]
    if not shown:
        raise KeyError("no native mode")
    return sep.join(shown)


def _x(value: float) -> str:
    return f"{value:.2f}×"


def _judged(text: str, met: bool) -> str:
    """A number against its goal: as it is where it meets it, in bold (Markdown) where it misses."""
    return text if met else f"**{text}**"


def _at_least(goal: float) -> Callable[[float], str]:
    return lambda value: _judged(_x(value), value >= goal)


def _at_most(goal: float) -> Callable[[float], str]:
    return lambda value: _judged(_x(value), value <= goal)


def _test(report: dict, kind: str, depth: str | None = None, mode: str | None = None) -> str:
    """The name of a test of a kind ("pp", "tg") in this run, plain or at a depth ("d4096"): llama.cpp's,
    or with a mode, that mode's."""
    return next(r.test for r in report["results"] if (r.mode == mode if mode else r.engine == "llama.cpp")
                and r.test.startswith(kind) and "+" not in r.test
                and (r.test.endswith(f"@ {depth}") if depth else "@" not in r.test))


def llama_cpp(report: dict) -> str:
    tests = [_test(report, "pp"), _test(report, "tg")]
    return ", ".join(f"{test} {_x(_row(report, 'phasescope', INT8, test) / _row(report, 'llama.cpp', None, test))}"
                     for test in tests)


def long_prompts(report: dict) -> str:
    """The longest prompt's prefill (-p 512,2048: pp2048) against llama.cpp's, at each depth the run measured
    (our fp32 cache, the default) or, without -d, alone."""
    results = report["results"]
    theirs = [r.test for r in results if r.engine == "llama.cpp" and r.test.startswith("pp") and "+" not in r.test]
    lengths = {test.split()[0] for test in theirs}
    if len(lengths) < 2:
        raise KeyError("one prompt length: no long prompt")
    longest = max(lengths, key=lambda test: int(test[2:]))
    tests = [test for test in theirs if test.split()[0] == longest]
    tests = [test for test in tests if "@" in test] or tests

    def show(mode: str) -> str:
        return " / ".join(_at_least(2.5)(_row(report, "phasescope", f"{mode}, KV fp32" if "@" in test else mode, test)
                                          / _row(report, "llama.cpp", None, test)) for test in tests)
    measured = {r.mode.split(",")[0] for r in results if r.engine == "phasescope"}
    shown = "; ".join(f"{mode.split()[-1]} {show(mode)}" for mode in (FP32, INT8) if mode in measured)
    depths = [test.split("@ ")[1] for test in tests if "@" in test]
    return f"{shown} ({longest}{' at ' + ' / '.join(depths) if depths else ''})"


def deep_decode(report: dict) -> str:
    test = _test(report, "tg", "d4096")
    ours, theirs = _row(report, "phasescope", f"{INT8}, KV int8", test), _row(report, "llama.cpp", None, test)
    return f"{_at_least(1.5)(ours / theirs)} ({ours:.1f} vs {theirs:.1f} tok/s)"


def int8_cache_speed(report: dict) -> str:
    test = _test(report, "tg", "d4096", mode=f"{INT8}, KV int8")  # llama.cpp need not have run
    int8, fp32 = (_row(report, "phasescope", f"{INT8}, KV {kv}", test) for kv in ("int8", "fp32"))
    return _judged(f"{int8:.1f} vs {fp32:.1f} tok/s", int8 > fp32)


def int8_cache(summary: dict) -> str:
    def show(part: dict) -> str:
        fp32_bytes, perplexity = part["KV fp16"]["bytes_per_token"] * 2, part["KV int8"]["vs_fp32"] - 1
        return f"{_at_least(4)(fp32_bytes / part['KV int8']['bytes_per_token'])} / " \
               f"{_judged(f'{perplexity:+.2%}', perplexity <= 0.02)}"
    return _both(summary["kv_formats_quality"], show, "; ")


def lookup(summary: dict) -> str:
    return _both(summary["speculative_prompt_lookup"], lambda part: f"{_at_least(1.8)(part['repeat']['speedup'])} / "
                 f"{_at_least(0.95)(part['no repeats']['speedup'])}"
                 f"{'' if part['repeat']['same_text'] and part['no repeats']['same_text'] else ', **TEXT DIFFERS**'}",
                 "; ")


def flash(summary: dict) -> str:
    lengths = next(iter(summary["flash_decoding"].values()))
    return _both(summary["flash_decoding"], lambda part: " / ".join(_at_least(1.3)(v["attention_speedup"])
                                                                    for v in part.values()),
                 "; ") + f" (at {' / '.join(lengths)} tokens)"


def int8_quality(summary: dict) -> str:
    decode, prefill = summary["quality_vs_fp32"]["int8"], summary["int8_prefill_quality"]["native"]
    def show(q: dict) -> str:
        top1, kl = q["top1_agreement"], q["mean_kl_nats"]
        return f"{_judged(f'{top1:.1%}', top1 >= 0.9)}, {_judged(f'KL {kl:.3f}', kl <= 0.02)}"
    return " / ".join(show(q) for q in (decode, prefill))


def attention(summary: dict) -> str:
    def show(part: dict) -> str:
        at = part.get("2048") or part[max(part, key=int)]
        native = at["eager"]["prefill_ms"] / at["auto"]["prefill_ms"]
        return f"{_judged(_x(native), native > 1)} (sdpa {_x(at['sdpa_vs_eager'])})"
    part = next(iter(summary["prefill_attention"].values()))
    length = "2048" if "2048" in part else max(part, key=int)
    return f"{_both(summary['prefill_attention'], show)} at {length} tokens; " \
           f"score matrix {part[length]['eager_score_matrix_mb']} MB"


def tensor_parallel(summary: dict) -> str:
    tp = summary["tensor_parallel"]
    two = next(v for k, v in tp.items() if k.startswith("2 ranks"))
    return (f"{_at_least(1.6)(tp['prefill_speedup'])} (all-reduce {two['prefill_all_reduce_share']:.1%} of prefill, "
            f"{two['decode_all_reduce_share']:.1%} of decode)")


def start(summary: dict) -> str:
    first_token, page = summary["cold_start_s"]["to_first_token_s"], summary["app_ready_s"]["page_s"]
    return f"{_judged(f'{first_token:.2f} s', first_token <= 1.5)} / {_judged(f'{page:.2f} s', page <= 3)}"


def browser(summary: dict) -> str:
    modes = summary["browser"]
    return " / ".join(_at_least(0.95)(modes[m]["browser_vs_cli"]) for m in ("int8", "fp32") if m in modes) + \
        " (Chromium " + " / ".join(f"{modes[m]['chromium_cpu_share']:.2f}" for m in ("int8", "fp32") if m in modes) + \
        " of a core)"


# (what is measured [the goal], how it reads from the report, or from its summary)
FIGURES: list[tuple[str, Callable[[dict], str], bool]] = [
    ("int8 vs llama.cpp, prefill and decode", llama_cpp, False),
    ("four requests vs one, fp32 / int8 [≥ 3×], same tokens",
     lambda s: _both(s["concurrency"], lambda p: f"{_at_least(3)(p['4']['decode_vs_1'])}"
                     f"{'' if p['4']['same_tokens_as_alone'] else ', **TOKENS DIFFER**'}"), True),
    ("TPOT at four vs one, fp32 / int8 [≤ 1.5×]",
     lambda s: _both(s["concurrency"], lambda p: _at_most(1.5)(p["4"]["tpot_vs_1"])), True),
    ("second turn vs a fresh chat, fp32 / int8 [≤ 1.3×]",
     lambda s: _both(s["second_turn"], lambda p: _at_most(1.3)(p["with prefix cache"]["vs_alone"])), True),
    ("one request vs a bare loop, prefill / decode, fp32 and int8 [≥ 0.95×]",
     lambda s: " and ".join(" / ".join(_judged(f"{p[key]:.3f}", p[key] >= 0.95)
                                       for key in ("prefill_vs_bare_loop", "decode_vs_bare_loop"))
                            for m, p in s["scheduler_cost"].items() if m in (FP32, INT8)), True),
    ("hooks + store, share of a decode step [≤ 3 %]",
     lambda s: _judged(f"{s['hooks']['hooks+store']['hook_share_of_step']:.1%}",
                       s["hooks"]["hooks+store"]["hook_share_of_step"] <= 0.03), True),
    ("long prompts vs llama.cpp, fp32; int8 weights [≥ 2.5×]", long_prompts, False),
    ("tg @ d4096 vs llama.cpp, int8 weights and cache [≥ 1.5×]", deep_decode, False),
    ("int8 cache vs fp32 cache at d4096, int8 weights [faster]", int8_cache_speed, False),
    ("int8 cache: bytes below fp32 [4×] / perplexity vs fp32 cache [≤ 2 %], fp32; int8 weights", int8_cache, True),
    ("prompt lookup, repeat [≥ 1.8×] / no repeats [≥ 0.95×], fp32; int8", lookup, True),
    ("Flash Decoding, attention split vs unsplit [≥ 1.3×], fp32; int8 weights", flash, True),
    ("a decode step without the cache vs with it, fp32 / int8",
     lambda s: _both(s["no_kv_cache"], lambda p: f"{p['slower']}× at {p['context']} tokens"
                     f"{'' if p['same_tokens'] else ', tokens differ'}"), True),
    ("int8 vs fp32, decode / prefill [top-1 ≥ 90 %, KL ≤ 0.02]", int8_quality, True),
    ("int8 prefill, native vs FBGEMM [≥ 0.9×]",
     lambda s: f"{_at_least(0.9)(s['int8_prefill_vs_fbgemm']['native_vs_fbgemm'])} "
               f"({s['int8_prefill_vs_fbgemm']['native']} vs {s['int8_prefill_vs_fbgemm']['FBGEMM']} tok/s)", True),
    ("native prefill attention vs eager, fp32 / int8 [faster]", attention, True),
    ("TP=2 vs one rank, one thread each, prefill [≥ 1.6×]", tensor_parallel, True),
    ("cold start to the first token [≤ 1.5 s] / page served [≤ 3 s]",
     start, True),
    ("browser vs CLI, decode, int8 / fp32 [≥ 0.95×]", browser, True),
]


def headline(report: dict) -> list[tuple[str, str]]:
    """(figure, this run's value) for each figure the run measured."""
    rows = []
    for label, read, from_summary in FIGURES:
        try:
            rows.append((label, read(report["summary"] if from_summary else report)))
        except (KeyError, StopIteration, TypeError, ZeroDivisionError, ValueError):
            continue  # not measured in this run
    return rows


def to_markdown(report: dict) -> list[str]:
    rows = headline(report)
    if not rows:
        return []
    return ["| figure [goal] | this run |", "|---|---|", *(f"| {label} | {value} |" for label, value in rows), ""]
