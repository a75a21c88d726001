"""Every precision mode against transformers' forward: tiny random models and the bundled model."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from app.bench.extras import QUALITY_TEXTS, quality_vs
from app.bench.figures import headline as figures_headline
from app.bench.tables import CONCURRENCY_HEADER, Result, load, render
from conftest import tiny_model
from engine import Engine, EngineConfig, SamplingParams
from engine.models.hf_runner import make_runner
from engine.models.llama import LeanLlama

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# largest logit difference allowed against transformers' forward in the same dtype (int8: vs fp32),
# as a fraction of the largest logit
TOLERANCE = {"fp32": 1e-5, "fp16": 0.02, "bf16": 0.08, "int8": 0.15}


def last_logits_both_ways(model, runner, ids: torch.Tensor, chunks: list[int]):
    with torch.no_grad():
        reference = model(ids[None]).logits[0, -1].float()
    cache, pos, logits = runner.new_cache(len(ids) + 1), 0, None
    for size in chunks + [len(ids)]:
        end = min(pos + size, len(ids))
        logits = runner.forward(ids[pos:end], pos, cache, need_logits=end == len(ids))
        pos = end
        if pos == len(ids):
            break
    return reference, logits.float()


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_model_logits_per_mode(tokenizer, kind, precision):
    loaded = tiny_model(tokenizer, kind)
    model = loaded.model if precision in ("fp32", "int8") else copy.deepcopy(loaded.model).to(DTYPES[precision])
    runner = make_runner(model, precision)
    assert (LeanLlama, precision) == (type(runner), runner.precision)
    ids = torch.tensor(tokenizer("Prefill reads the prompt; decode writes the reply.")["input_ids"])
    reference, logits = last_logits_both_ways(loaded.model if precision == "int8" else model, runner, ids, [4, 3])
    assert (logits - reference).abs().max() <= TOLERANCE[precision] * reference.abs().max()


def test_int8_is_refused_where_the_lean_path_cannot_run(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer))).eval()
    with pytest.raises(ValueError, match="int8 needs the lean Llama-family path"):
        make_runner(model, "int8")
    assert "transformers" == make_runner(model, "auto").name  # other architectures fall back


def test_a_model_loaded_in_half_precision_switches_to_fp32_and_int8_from_its_file(tmp_path, tokenizer):
    """Started with --precision fp16, the page's switch to fp32 ran the fp16 weights and called them fp32,
    and to int8 failed every reply ('expected scalar type Float but found Half'): the fp32 weights are read
    again from the folder (exactly the fp32 load's, not an upcast of the half ones)."""
    from engine import load_model

    tiny_model(tokenizer).model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = Engine(load_model(str(tmp_path), "cpu", "float16", lean=True), EngineConfig(precision="fp16"))
    reference = make_runner(load_model(str(tmp_path), "cpu", "float32", lean=True).model, "fp32")
    ids = torch.tensor(tokenizer("Prefill reads the prompt; decode writes the reply.")["input_ids"])
    engine.switch_precision("fp32")
    assert ("fp32", "float32") == (engine.info.precision, engine.info.dtype)
    logits = [runner.forward(ids, 0, runner.new_cache(len(ids))) for runner in (engine.runner, reference)]
    assert torch.equal(*logits)
    for precision in ("int8", "bf16", "fp16"):
        engine.switch_precision(precision)
        finished = engine.generate([{"role": "user", "content": "Hi"}], SamplingParams(max_new_tokens=4))
        assert finished.error is None and 4 == finished.metrics.num_generated_tokens, precision


def test_weights_that_would_not_fit_are_refused_in_one_line_and_the_running_precision_stays(tokenizer, monkeypatch):
    # the kernel kills a process that runs out of memory: a 7 B model switched to fp32 (28 GB) on a 24 GB
    # machine took the page, its replies and every tab with it, without a word
    from app.bench.extras import precision_report
    from app.ui.language import user_error
    from app.ui.panels import precision_html
    from engine import NotEnoughMemory
    from engine.models import loader

    loaded = tiny_model(tokenizer)  # about 12.6 MB of weights in fp32, 3.2 MB in int8
    engine = Engine(loaded, EngineConfig(precision="int8"))
    monkeypatch.setattr(loader, "free_memory", lambda: 6_000_000)
    with pytest.raises(NotEnoughMemory, match=r"^the weights need about 0\.0 GB in fp32 and 0\.0 GB of memory is "
                                              r"free: choose int8 \(about 0\.0 GB\)$") as refused:
        engine.switch_precision("fp32")
    assert "int8" == engine.info.precision  # still running, as before
    finished = engine.generate([{"role": "user", "content": "Hi"}], SamplingParams(max_new_tokens=4))
    assert finished.error is None and 4 == finished.metrics.num_generated_tokens
    assert refused.value.needed_gb > 0.012 and "请选择 int8" in user_error("zh", refused.value)

    report = precision_report(loaded, engine.runner)  # its fp32 reference would not fit either: speed alone
    assert "no_reference_gb" in report and "top1_agreement" not in report
    assert "not compared with fp32" in precision_html(report, "en") and "未与 fp32 对比" in precision_html(report, "zh")

    monkeypatch.setattr(loader, "free_memory", lambda: 1_000_000)
    with pytest.raises(NotEnoughMemory, match="in int8 .*: close other programs or choose a smaller model$"):
        make_runner(loaded.model, "int8")


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, fp16, bf16, int8"):
        EngineConfig(precision="int4")


@pytest.mark.model
def test_bundled_int8_quality_and_kv_cache(bundled):
    reference, quantized = make_runner(bundled.model, "fp32"), make_runner(bundled.model, "int8")
    quality = quality_vs(reference, quantized, bundled.tokenizer)
    assert "fused C++" == quantized.decode_path
    assert quality["top1_agreement"] >= 0.85, quality  # measured 0.905 on these texts
    assert 0 < quality["mean_kl_nats"] < 0.04, quality  # measured 0.016 (FBGEMM's per-tensor activations: 0.048)
    assert quality["positions"] == sum(len(bundled.tokenizer(t)["input_ids"]) for t in QUALITY_TEXTS)
    assert 135_000_000 < quantized.weight_bytes < 140_000_000  # int8 weights, fp32 scales and norms
    assert 3.9 < reference.weight_bytes / quantized.weight_bytes < 4.0
    engine = Engine(bundled, EngineConfig(precision="int8"), runner=quantized)
    finished = engine.generate([{"role": "user", "content": "What is a KV cache?"}],
                               SamplingParams(max_new_tokens=16, temperature=0))
    assert finished.text and finished.metrics.kv_bytes == 46080 * finished.metrics.kv_tokens  # fp32 KV cache


@pytest.mark.sweep
@pytest.mark.model
def test_bench_quick_produces_a_well_formed_table(tmp_path):
    result = subprocess.run([sys.executable, "-m", "app.cli", "bench", "--quick", "--output", "json", "-d", "0,64",
                             "-p", "32,48", "--tensor-parallel", "1"],
                            capture_output=True, text=True, timeout=600)
    assert 0 == result.returncode, result.stderr
    report = json.loads(result.stdout)
    rows = {(r["engine"], r["mode"], r["test"]): r for r in report["results"]}
    for mode in ("lean-llama fp32", "lean-llama int8"):
        for test in ("pp32", "tg8", "pp32+tg8"):
            row = rows[("phasescope", mode, test)]
            assert row["tokens_per_s"] > 0 and len(row["samples"]) == 1
            assert row["vs_transformers"].endswith("×")
        assert rows[("phasescope", mode, "pp48")]["tokens_per_s"] > 0  # -p's second length: prefill alone
        assert ("phasescope", mode, "pp48+tg8") not in rows
    assert ("transformers", "eager generate float32", "tg8") in rows
    assert ("transformers", "eager generate float32", "pp48") in rows
    assert rows[("phasescope", "lean-llama int8", "tg8")]["achieved"].endswith("GB/s of weights")
    assert rows[("phasescope", "lean-llama fp32", "pp32")]["achieved"].endswith("GFLOP/s")
    assert rows[("phasescope", "lean-llama int8", "pp48")]["achieved"].endswith("GFLOP/s")
    summary = report["summary"]
    assert {"none", "hooks", "hooks+store"} == set(summary["hooks"])
    assert summary["fp32_greedy_equals_transformers"] is True
    assert {"fp16", "int8", "int8 via FBGEMM"} == set(summary["quality_vs_fp32"])
    assert {"int8"} == set(summary["weights_quality_long_text"])
    versus = summary["int8_prefill_vs_fbgemm"]  # the same prompt through both int8 matmuls, alternating
    assert versus["native"] > 0 < versus["FBGEMM"] and versus["native_vs_fbgemm"] > 0
    assert 0.5 < summary["weights_quality_long_text"]["int8"]["top1_agreement"] <= 1
    assert {"lean-llama fp32": "fused C++", "lean-llama fp16": "PyTorch ops",
            "lean-llama int8": "fused C++"} == summary["decode_paths"]
    assert summary["native_decode_vs_pytorch_ops"]["lean-llama int8"]["speedup"] > 0
    assert list(summary["sampling"])[:3] == ["greedy", "temperature 0.7", "temperature 0.7, top-p 0.9"]
    chats = list(summary["sampling"])[3:]  # the chat's whole rule, named with its settings
    assert len(chats) == 1 and chats[0].startswith("the chat's: ") and "repetition penalty" in chats[0]
    assert summary["sampling"][chats[0]]["tpot_ms"] > 0
    assert summary["sampling"]["greedy"]["over_greedy_ms"] == 0 < summary["sampling"]["temperature 0.7"]["tpot_ms"]
    assert summary["cold_start_s"]["to_first_token_s"] > 0
    assert set(summary["machine_load"]) == {"others_cores", "steal_cores"}  # how busy the rest of the machine was
    assert 0 < summary["app_ready_s"]["page_s"] <= summary["app_ready_s"]["model_s"]
    for mode in ("lean-llama fp32", "lean-llama int8"):  # the native modes: batching and prefix caching
        levels = summary["concurrency"][mode]
        assert ["1", "2"] == list(levels) and all(v["same_tokens_as_alone"] for v in levels.values())
        assert levels["2"]["decode_tokens_per_s"] > 0 and levels["1"]["tpot_vs_1"] == 1.0
        turns = summary["second_turn"][mode]
        assert turns["with prefix cache"]["cached_tokens"] > 0 == turns["without"]["cached_tokens"]
        assert summary["scheduler_cost"][mode]["decode_vs_bare_loop"] > 0
        for kv in ("KV fp32", "KV fp16", "KV int8"):  # prefill and decode after 0 and 64 cached tokens, each format
            for depth in (0, 64):
                for test in ("pp32", "tg8"):
                    assert rows[("phasescope", f"{mode}, {kv}", f"{test} @ d{depth}")]["tokens_per_s"] > 0
                assert (("phasescope", f"{mode}, {kv}", f"pp48 @ d{depth}") in rows) == (kv == "KV fp32")
        spec = summary["speculative_prompt_lookup"][mode]
        assert spec["repeat"]["same_text"] and spec["no repeats"]["same_text"]
        assert summary["no_kv_cache"][mode]["no_cache_step_gflop"] > summary["no_kv_cache"][mode]["cached_step_gflop"]
        flash = summary["flash_decoding"][mode]  # split vs unsplit decode steps at 256 and 512 tokens of context
        assert ["256", "512"] == list(flash) and flash["512"]["split_step_ms"] > 0 < flash["512"]["unsplit_step_ms"]
        assert set(flash["512"]["kv_read_gb_s"]) == {"unsplit", "split"}  # None where the attention read as <= 0
        assert all(rate > 0 for rate in flash["512"]["machine_read_gb_s"].values())
        quality = summary["kv_formats_quality"][mode]
        assert quality["tokens"] == 48 and quality["KV fp16"]["bytes_per_token"] == 46080 // 2
        assert quality["KV int8"]["bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
        assert quality["KV window 32 + 4 sinks"]["perplexity"] > 0
        attention = summary["prefill_attention"][mode]  # native, sdpa and eager prefill at 16 and 32 tokens
        assert ["16", "32"] == list(attention) and attention["32"]["eager"]["prefill_ms"] > 0
    # the same run as the default output, a Markdown table, rendered from the saved JSON (a second run: 30 s)
    saved = tmp_path / "run.json"
    saved.write_text(result.stdout)
    shown = subprocess.run([sys.executable, "-m", "app.cli", "bench", "--from-json", str(saved)],
                           capture_output=True, text=True, timeout=120)
    assert 0 == shown.returncode, shown.stderr
    markdown = shown.stdout
    assert markdown.startswith("| engine | mode | test | tokens/s | vs transformers | vs llama.cpp | achieved |")
    tg8 = next(line for line in markdown.splitlines() if line.startswith("| phasescope | lean-llama int8 | tg8 |"))
    # the ratio to transformers in its column; from the JSON's samples, rounded to 0.01, so within 0.02
    shown = float(tg8.split("|")[5].strip().rstrip("×"))
    assert abs(shown - float(rows[("phasescope", "lean-llama int8", "tg8")]["vs_transformers"].rstrip("×"))) <= 0.02
    assert CONCURRENCY_HEADER in markdown
    assert "while it ran, programs outside it used " in markdown
    figures = dict(figures_headline(load(saved)))  # what the run measured, no more
    assert figures["int8 vs fp32, decode / prefill [top-1 ≥ 90 %, KL ≤ 0.02]"].count("KL") == 2
    assert figures["hooks + store, share of a decode step [≤ 3 %]"].strip("*").endswith("%")  # bold if > 3 %
    assert not any(label.startswith("four requests") for label in figures)  # --quick runs 1 and 2 only
    assert all(f"| {label} | {value} |" in markdown for label, value in figures.items())
    assert "| lean-llama int8 | 2 |" in markdown


def test_llama_bench_depth_rows_are_named_as_ours(tmp_path):
    """llama-bench's rows (a stand-in binary printing its JSON) become results named like the engine's:
    pp512, tg128, and tg128 @ d1024 for its -d runs."""
    from app.bench.extras import llama_bench

    fake = tmp_path / "llama-bench"
    rows = {"plain": [{"n_prompt": 512, "n_gen": 0, "avg_ts": 300.0, "stddev_ts": 1.0, "samples_ts": [300.0]},
                      {"n_prompt": 0, "n_gen": 128, "avg_ts": 200.0, "stddev_ts": 1.0, "samples_ts": [200.0]}],
            "deep": [{"n_prompt": 0, "n_gen": 128, "n_depth": 1024, "avg_ts": 110.0, "stddev_ts": 1.0,
                      "samples_ts": [110.0]}]}
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\n"
                    f"rows = {rows!r}\nprint(json.dumps(rows['deep' if '-d' in sys.argv else 'plain']))\n")
    fake.chmod(0o755)
    results = llama_bench(str(fake), "model.gguf", 512, 128, 1, log=lambda line: None, depths=(1024,))
    assert ["pp512", "tg128", "tg128 @ d1024"] == [test for _, test, _ in results]
    assert [110.0] == results[-1][2]
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path / 'argv'}\necho []\n")
    llama_bench(str(fake), "model.gguf", 512, 128, 1, log=lambda line: None, depths=(0, 4096), more_pp=(2048,))
    plain, deep = (tmp_path / "argv").read_text().splitlines()  # every prompt length, plain and at each depth
    assert "-p 512,2048 -n 128 -pg 512,128 " in plain and "-p 512,2048 -n 128 -d 0,4096 " in deep


def test_a_wrong_llama_bench_path_stops_the_bench_before_it_starts(tmp_path):
    """A mistyped --llama-bench fails at once, not after the twenty minutes before llama.cpp's turn; one
    that stops running meanwhile, or answers with something else than its JSON rows, leaves the rows
    measured so far."""
    from app.bench.extras import llama_bench

    plain = tmp_path / "llama-bench"
    plain.write_text("#!/bin/sh\n")
    for path, message in ((tmp_path / "nope", "no such file"), (plain, "not executable")):
        out = subprocess.run([sys.executable, "-m", "app.cli", "bench", "--quick", "--llama-bench", str(path)],
                             capture_output=True, text=True)
        assert out.returncode == 2 and f"--llama-bench {path}: {message}" in out.stderr
        assert "phasescope bench: pp" not in out.stderr and "Traceback" not in out.stderr  # nothing ran
    lines = []
    assert llama_bench(str(tmp_path / "gone"), "model.gguf", 512, 128, 1, log=lines.append) == []
    assert "llama-bench did not run" in lines[0]
    for printed in ("usage: llama-bench [options]", "[1, 2]", '[{"avg_ts": 1}]'):  # another tool, an old one
        plain.write_text(f"#!/bin/sh\necho '{printed}'\n")
        plain.chmod(0o755)
        lines.clear()
        assert llama_bench(str(plain), "model.gguf", 512, 128, 1, log=lines.append) == []
        assert f"llama-bench did not answer with llama-bench's JSON rows (is {plain} llama-bench?)" in lines[0]


def test_too_many_ranks_or_an_unknown_mode_stop_the_bench_before_it_measures():
    out = subprocess.run([sys.executable, "-m", "app.cli", "bench", "--quick", "--tensor-parallel", "10"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "this model has 9, so 1 to 9 ranks, not 10" in out.stderr, out.stderr
    assert "tok/s" not in out.stderr and "Traceback" not in out.stderr  # nothing was measured
    out = subprocess.run([sys.executable, "-m", "app.cli", "bench", "--quick", "--modes", "fp32,int4"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip() == ("phasescope: error: --modes takes auto, fp32, fp16, "
                                                          "bf16, int8, separated by commas, got 'fp32,int4'")


def test_a_model_on_transformers_forward_is_told_what_measures_it(gpt2_folder):
    out = subprocess.run([sys.executable, "-m", "app.cli", "bench", "--quick", "--model", str(gpt2_folder)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"phasescope: error: bench measures the lean forward of the Llama family; {gpt2_folder.name} (gpt2) runs "
        "on transformers' forward: measure its TTFT and TPOT with `phasescope generate --json` or the page")


def test_headline_figures_read_what_the_run_measured_and_leave_out_the_rest():
    """Each figure the run measured, the numbers that miss their goals in bold (as the README shows them)."""
    from app.bench.figures import headline

    int8, kv = "lean-llama int8", "lean-llama int8, KV int8"
    results = [Result("phasescope", int8, "pp512", [600.0]), Result("phasescope", int8, "tg128", [150.0]),
               Result("llama.cpp", "llama 256M Q4_1, 2 threads", "pp512", [200.0]),
               Result("llama.cpp", "llama 256M Q4_1, 2 threads", "tg128", [100.0]),
               Result("phasescope", kv, "tg128 @ d4096", [90.0]),
               Result("phasescope", "lean-llama int8, KV fp32", "tg128 @ d4096", [60.0])]
    summary = {"concurrency": {int8: {"4": {"decode_vs_1": 2.5, "tpot_vs_1": 1.6, "same_tokens_as_alone": False}}},
               "cold_start_s": {"to_first_token_s": 1.2},  # no app_ready_s: that figure is left out
               "browser": {"int8": {"browser_vs_cli": 0.96, "chromium_cpu_share": 0.4},
                           "fp32": {"browser_vs_cli": 0.94, "chromium_cpu_share": 0.2}},
               "speculative_prompt_lookup": {int8: {"repeat": {"speedup": 1.79, "same_text": True},
                                                    "no repeats": {"speedup": 0.95, "same_text": True}}}}
    figures = dict(headline({"results": results, "summary": summary}))
    assert figures == {
        "int8 vs llama.cpp, prefill and decode": "pp512 3.00×, tg128 1.50×",  # no goal in brackets
        "four requests vs one, fp32 / int8 [≥ 3×], same tokens": "**2.50×**, **TOKENS DIFFER**",
        "TPOT at four vs one, fp32 / int8 [≤ 1.5×]": "**1.60×**",
        "int8 cache vs fp32 cache at d4096, int8 weights [faster]": "90.0 vs 60.0 tok/s",
        "prompt lookup, repeat [≥ 1.8×] / no repeats [≥ 0.95×], fp32; int8": "**1.79×** / 0.95×",
        "browser vs CLI, decode, int8 / fp32 [≥ 0.95×]": "0.96× / **0.94×** (Chromium 0.40 / 0.20 of a core)",
    }  # no llama.cpp row at d4096: its comparison is left out, ours against our fp32 cache stays


def test_long_prompts_against_llama_cpp_at_each_depth_or_alone():
    """-p 512,2048: the longest prompt's prefill against llama.cpp's at each depth (our fp32 cache), or
    without -d the plain rows; no such figure when the run had one prompt length."""
    from app.bench.figures import headline

    label = "long prompts vs llama.cpp, fp32; int8 weights [≥ 2.5×]"
    llama = "llama 256M Q4_1, 2 threads"
    plain = [Result("phasescope", mode, test, [value]) for mode in ("lean-llama fp32", "lean-llama int8")
             for test, value in (("pp512", 900.0), ("pp2048", 600.0))] + \
        [Result("llama.cpp", llama, "pp512", [300.0]), Result("llama.cpp", llama, "pp2048", [200.0])]
    assert dict(headline({"results": plain, "summary": {}}))[label] == "fp32 3.00×; int8 3.00× (pp2048)"
    deep = [Result("phasescope", f"{mode}, KV {kv}", f"{test} @ d{depth}", [value])
            for mode, value in (("lean-llama fp32", 480.0), ("lean-llama int8", 600.0)) for kv in ("fp32", "int8")
            for depth in (0, 4096) for test in ("pp512", "pp2048")] + \
        [Result("llama.cpp", llama, f"{test} @ d{depth}", [value])
         for test in ("pp512", "pp2048") for depth, value in ((0, 200.0), (4096, 100.0))]
    assert dict(headline({"results": plain + deep, "summary": {}}))[label] == \
        "fp32 **2.40×** / 4.80×; int8 3.00× / 6.00× (pp2048 at d0 / d4096)"
    one_length = [r for r in plain + deep if not r.test.startswith("pp2048")]
    assert label not in dict(headline({"results": one_length, "summary": {}}))
    longest_first = sorted(plain, key=lambda r: r.test != "pp2048")  # -p 2048,512: the same figure
    assert dict(headline({"results": longest_first, "summary": {}}))[label] == "fp32 3.00×; int8 3.00× (pp2048)"


def test_bench_prompt_lengths_are_checked_before_the_model_loads():
    for given, message in (("512,x", "-p takes numbers separated by commas, got '512,x'"),
                           ("512,0", "-p takes numbers >= 1"), (",", "-p takes numbers separated by commas, got none")):
        out = subprocess.run([sys.executable, "-m", "app.cli", "bench", "-p", given], capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.strip() == f"phasescope: error: {message}", out.stderr


def test_a_saved_run_renders_again_and_a_wrong_file_says_so_in_one_line(tmp_path, capsys):
    """`bench --from-json FILE` measures nothing: a run saved with --output json comes back as its tables;
    a file that is not one, or is not there, gets a line saying so."""
    from app.cli import main

    results = [Result("phasescope", "lean-llama int8", "tg128", [150.0, 152.0], "35.6 GB/s of weights"),
               Result("llama.cpp", "llama 256M Q4_1, 2 threads", "tg128", [100.0])]
    saved = tmp_path / "run.json"
    saved.write_text(render({"results": results, "summary": {"machine": "x86_64", "model": "m", "best_mode": "int8"}},
                            "json"))
    assert 0 == main(["bench", "--from-json", str(saved)])
    out, err = capsys.readouterr()
    assert "| phasescope | lean-llama int8 | tg128 | 151.0 ± 1.4 |  | 1.51× | 35.6 GB/s of weights |" in out
    assert "machine: x86_64; model: m; best mode: int8" in out and err == ""
    assert load(saved)["results"] == results
    (tmp_path / "other.json").write_text('{"levels": []}')  # e.g. `bench --endpoint`'s JSON
    for path in (tmp_path / "other.json", tmp_path / "gone.json"):
        assert 2 == main(["bench", "--from-json", str(path)])
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("phasescope: error:") and str(path) in err
