"""The native decode step and prefill attention (engine/kernels/csrc/decode_step.cpp) against the PyTorch ops they
replace."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model, user
from engine import Engine, EngineConfig, ModelError, SamplingParams
from engine.kernels import fused
from engine.kernels.fused import KernelUnavailable, build_library
from engine.kv_pool import SequenceKV
from engine.models.hf_runner import make_runner
from engine.models.llama import LeanLlama
from engine.sampling import SeenTokens, apply_repetition_penalty, make_generator, sample, top_logits, top_tempered

PROMPT = "Prefill reads the prompt; decode writes the reply."


def decode_both_ways(loaded, precision: str, ids: torch.Tensor, num_steps: int = 6):
    """Prefill ids, then decode num_steps fixed tokens, once natively and once with PyTorch ops:
    (logits per step, KV cache) for each."""
    runner = make_runner(loaded.model, precision)
    assert "fused C++" == runner.decode_path

    def run():
        cache = runner.new_cache(len(ids) + num_steps)
        runner.forward(ids, 0, cache)
        steps = [runner.forward(torch.tensor([7 + step]), len(ids) + step, cache) for step in range(num_steps)]
        return torch.stack(steps), cache

    native = run()
    with runner.pytorch_decode():
        return [native, run()]


@pytest.mark.parametrize("kind, heads, kv_heads, hidden", [("llama", 4, 2, 64), ("mistral", 4, 2, 64),
                                                           ("qwen2", 4, 2, 64), ("llama", 4, 2, 256)])
def test_fp32_native_decode_equals_pytorch_ops(tokenizer, kind, heads, kv_heads, hidden):
    # head dimension 16: the kernel's generic attention; 64 (SmolLM2's), 2 query heads per KV head: its unrolled one
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    loaded = tiny_model(tokenizer, kind, num_heads=heads, num_kv_heads=kv_heads, hidden=hidden)
    (native, native_cache), (ops, ops_cache) = decode_both_ways(loaded, "fp32", ids)
    assert (native - ops).abs().max() <= 1e-5 * ops.abs().max()
    assert native_cache.num_tokens == ops_cache.num_tokens == len(ids) + 6
    assert torch.allclose(native_cache.pool.kv[..., :native_cache.num_tokens, :],  # same keys and values,
                          ops_cache.pool.kv[..., :ops_cache.num_tokens, :], atol=1e-5)  # same slots


@pytest.mark.parametrize("heads, kv_heads, hidden", [(4, 4, 256), (6, 2, 384), (2, 1, 256)])  # D 64, 64, 128
def test_native_prefill_attention_reads_a_scattered_table_like_sdpa_reads_gathered_keys(tokenizer, heads, kv_heads,
                                                                                        hidden):
    runner = make_runner(tiny_model(tokenizer, num_heads=heads, num_kv_heads=kv_heads, hidden=hidden).model, "fp32")
    assert runner.fused.has_prefill_attention
    pool = runner.new_pool(1 << 24, prefix_caching=False)
    head_dim, generator = runner.head_dim, torch.Generator().manual_seed(0)
    pool.kv.normal_(generator=generator)  # the cached prefix: whatever the pool holds
    # 600 keys: three of the kernel's blocks of 256, the running maximum growing in later ones
    cached, num_tokens = 579, 21
    num_blocks = math.ceil((cached + num_tokens) / pool.block_size)
    blocks = torch.randperm(pool.num_blocks, generator=generator)[:num_blocks].tolist()
    sequence = SequenceKV(pool, blocks, num_cached_tokens=cached)  # not consecutive: no view would do
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    qkv[:, :heads * head_dim] *= 4  # sharp weights: where the maximum sits matters
    out = runner.fused.prefill_attention(qkv, 0, cached, sequence)

    keys, values = sequence.layer_kv(0, cached + num_tokens)  # gathered: [KV, 600, D]
    written = qkv[:, heads * head_dim:].view(num_tokens, 2, kv_heads, head_dim).permute(1, 2, 0, 3)
    assert torch.equal(keys[:, cached:], written[0]) and torch.equal(values[:, cached:], written[1])
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim).transpose(0, 1)
    causal = torch.arange(cached + num_tokens)[None, :] <= torch.arange(cached, cached + num_tokens)[:, None]
    expected = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=causal,
                                              enable_gqa=heads != kv_heads)[0].transpose(0, 1).flatten(1)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    # a token's output does not depend on how the prompt was cut into chunks (prefix caching stays exact)
    tail = runner.fused.prefill_attention(qkv[-5:].clone(), 0, cached + num_tokens - 5, sequence)
    assert torch.equal(tail, out[-5:])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_int8_native_decode_is_close_to_fp32(tokenizer, kind):
    loaded = tiny_model(tokenizer, kind)
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    (int8, _), _ = decode_both_ways(loaded, "int8", ids)
    (fp32, _), _ = decode_both_ways(loaded, "fp32", ids)
    assert (int8 - fp32).abs().max() <= 0.05 * fp32.abs().max()
    assert (int8.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8


def test_int8_native_logits_of_a_sequence_are_the_same_in_any_batch(tokenizer):
    """Bit for bit, for batches of 1 to 9 sequences: whole groups of four, a last group padded with empty
    sequences (2 or 3 left over), pairs of groups sharing their arithmetic, and one left on its own."""
    loaded = tiny_model(tokenizer, hidden=128)  # two blocks of 64 per row
    runner = make_runner(loaded.model, "int8")
    assert runner.decode_path == "fused C++"
    pool = runner.new_pool(8 << 20, prefix_caching=False)
    prompts = [torch.tensor(tokenizer(f"{PROMPT} Sequence {i}.")["input_ids"]) for i in range(9)]
    caches = []
    for ids in prompts:
        caches.append(pool.allocate([], len(ids) + 2))
        runner.forward(ids, 0, caches[-1])

    def step(indices: list[int]) -> torch.Tensor:  # one decode step; every cache rolled back after it
        logits = runner.decode([11 + i for i in indices], [len(prompts[i]) for i in indices],
                               [caches[i] for i in indices])
        for i in indices:
            caches[i].truncate(len(prompts[i]))
        return logits

    alone = [step([i])[0] for i in range(9)]
    for size in range(2, 10):
        batch = step(list(range(9 - size, 9)))  # different neighbours for each size
        for row, i in enumerate(range(9 - size, 9)):
            assert torch.equal(batch[row], alone[i]), (size, i)


@pytest.mark.parametrize("arch", ["-march=x86-64-v3", "-march=x86-64-v3 -mavxvnni", "-march=x86-64"])
def test_every_instruction_set_path_gives_the_same_logits(tokenizer, tmp_path, monkeypatch, arch):
    """The kernel's AVX2, AVX-VNNI and plain-C++ paths against the one built for this CPU (on a CPU
    that lacks an instruction set, its build would not run: skipped)."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("x86 instruction sets")
    loaded = tiny_model(tokenizer)
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    for precision in ("fp32", "int8"):
        (native, _), _ = decode_both_ways(loaded, precision, ids)
        monkeypatch.setenv("PHASESCOPE_NATIVE_ARCH", arch)
        if "avxvnni" in arch and "avx_vnni" not in open("/proc/cpuinfo").read():
            pytest.skip("this CPU has no AVX-VNNI")
        runner = LeanLlama(loaded.model, precision, cache_dir=str(tmp_path))
        monkeypatch.delenv("PHASESCOPE_NATIVE_ARCH")
        cache = runner.new_cache(len(ids) + 6)
        runner.forward(ids, 0, cache)
        other = torch.stack([runner.forward(torch.tensor([7 + step]), len(ids) + step, cache) for step in range(6)])
        torch.testing.assert_close(other, native, atol=1e-4 * native.abs().max().item(), rtol=1e-4)
    from engine.sampling import _kept  # and sampling's top-p over the vocabulary, packed with or without AVX-512

    scores = torch.randn(49152, generator=torch.Generator().manual_seed(2)) * 3
    assert runner.nucleus(scores, 1 / 0.7, 0.9)[0] == _kept((scores.double() / 0.7).softmax(-1), 0, 0.9)[0].tolist()


@pytest.mark.model
def test_bundled_greedy_tokens_are_the_same_natively_and_with_pytorch_ops(bundled):
    engine = Engine(bundled, EngineConfig(precision="fp32"))
    assert "fused C++" == engine.runner.decode_path
    messages = [{"role": "user", "content": "Name three colors."}]
    sampling = SamplingParams(max_new_tokens=24, temperature=0)
    native = engine.generate(messages, sampling).text
    with engine.runner.pytorch_decode():
        assert "PyTorch ops" == engine.runner.decode_path
        assert native == engine.generate(messages, sampling).text
    assert "fused C++" == engine.runner.decode_path


def test_top_logits_natively_and_with_torch(tokenizer):
    runner = make_runner(tiny_model(tokenizer).model, "fp32")
    logits = torch.randn(5000) * 4
    logits[123] = logits[456] = logits.max() + 1  # a tie goes to the lower id, as argmax does
    ids, values, lse = runner.top_logits(logits, 5)
    expected_ids, expected_values, expected_lse = top_logits(logits, 5)
    assert ids[0] == 123 == int(logits.argmax())
    assert set(ids) == set(expected_ids) and ids[2:] == expected_ids[2:]
    assert values == pytest.approx(expected_values) and lse == pytest.approx(expected_lse, rel=1e-6)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (0, 0.5), (0, 0.99), (40, 0.9), (40, 1.0), (3, 0.9)])
def test_top_p_from_the_most_likely_alone_keeps_what_the_full_search_keeps(tokenizer, top_k, top_p):
    """sampling._nucleus (one ranking pass: the native one, or torch's) against _kept over the whole
    softmax: the same tokens in the same order, the same probabilities; or None, for _kept to look further,
    only where the first NUCLEUS_FIRST hold less than top_p."""
    from engine.sampling import NUCLEUS_FIRST, _kept, _nucleus

    runner = make_runner(tiny_model(tokenizer).model, "fp32")
    generator = torch.Generator().manual_seed(11)
    looked_further = 0
    for scale in (0.3, 1.0, 3.0, 8.0):
        for temperature in (0.2, 0.7, 1.5):
            scores = torch.randn(49152, generator=generator) * scale
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            probs = (scores.double() / temperature).softmax(-1)
            expected_ids, expected_probs = _kept(probs, top_k, top_p)
            for rank_fn in (runner.top_tempered, top_tempered):
                found = _nucleus(scores, params, rank_fn)
                if found is None:
                    assert not top_k and float(probs.topk(NUCLEUS_FIRST).values.sum()) < top_p
                    looked_further += 1
                    continue
                ids, kept_probs = found
                assert ids == expected_ids.tolist()
                assert kept_probs == pytest.approx(expected_probs.tolist(), rel=1e-4)
    assert looked_further < 24  # the peaked ones are found from the first NUCLEUS_FIRST


def test_native_nucleus_keeps_what_the_full_search_keeps(tokenizer):
    """FusedDecode.nucleus (a histogram of the probabilities, then the tokens up to where top-p ends) against
    _kept's float64 softmax and topk over the whole vocabulary, flat distributions included: the same tokens
    in the same order, the same probabilities; None only past its cap."""
    from engine.sampling import _kept

    runner = make_runner(tiny_model(tokenizer).model, "fp32")
    generator = torch.Generator().manual_seed(5)
    sizes = []
    for spread in (0.3, 1.0, 3.0, 8.0):
        for temperature in (0.2, 0.7, 1.5):
            for top_p in (0.5, 0.9, 0.99):
                scores = torch.randn(49152, generator=generator) * spread
                expected_ids, expected_probs = _kept((scores.double() / temperature).softmax(-1), 0, top_p)
                found = runner.nucleus(scores, 1 / temperature, top_p)
                if found is None:
                    assert len(expected_ids) > runner.fused.NUCLEUS_CAP
                    continue
                ids, probs = found
                assert ids == expected_ids.tolist()
                assert probs == pytest.approx(expected_probs.tolist(), rel=1e-4)
                sizes.append(len(ids))
    assert min(sizes) < 64 < 1000 < max(sizes)  # peaked and flat ones both found
    tied = torch.zeros(300)
    tied[[40, 7, 99]] = 5.0  # the three most likely alike: the lower id first, as argmax does
    assert [7, 40, 99] == runner.nucleus(tied, 1.0, 0.5)[0]
    nan = torch.randn(1000)
    nan[5] = float("nan")
    assert runner.nucleus(nan, 1.0, 0.9) is None


@pytest.mark.parametrize("scale", [1.0, 1 / 0.7, 5.0, 1e30])
def test_top_tempered_natively_and_with_torch(tokenizer, scale):
    """The k largest as they are, and the log-normalizer of the scores shifted below the largest and
    scaled (1 / temperature): from one pass, with no scaled copy of the vocabulary."""
    runner = make_runner(tiny_model(tokenizer).model, "fp32")
    scores = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 4
    ids, values, lse = runner.top_tempered(scores, 64, scale)
    expected_ids, expected_values, expected_lse = top_tempered(scores, 64, scale)
    assert ids == expected_ids and values == pytest.approx(expected_values)
    assert lse == pytest.approx(float(((scores.double() - scores.max()) * scale).logsumexp(-1)), rel=1e-5, abs=1e-6)
    assert lse == pytest.approx(expected_lse, rel=1e-5, abs=1e-6)
    nan = scores.clone()
    nan[7] = float("nan")
    assert math.isnan(runner.top_tempered(nan, 5, scale)[2])  # sample's _ranked then looks no further


def test_native_repetition_penalty_equals_torchs_and_samples_the_same_tokens(tokenizer):
    """The runner's penalty (one native call) gives PyTorch's scores bit for bit, NaN and infinities
    included, passes over ids outside the vocabulary, and leaves the logits as they were; sampling with it
    draws the same tokens from the same seeds."""
    runner = make_runner(tiny_model(tokenizer).model, "fp32")
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(4)) * 4
    logits[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30])
    before = logits.clone()
    seen = SeenTokens([0, 1, 2, 3, 4, 5, 17, 4999, 17, 300]).ids([12, 300, 77])

    def same(a, b):  # equal, NaN where NaN
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])

    for penalty in (1.1, 1.3, 0.8):
        assert same(runner.penalized(logits, seen, penalty), apply_repetition_penalty(logits, seen, penalty))
    assert same(before, logits)
    assert runner.penalized(logits, seen, 1.0) is logits and runner.penalized(logits, seen[:0], 1.1) is logits
    outside = runner.penalized(logits, torch.tensor([5000, -1, 10], dtype=torch.long), 2.0)
    assert same(outside, apply_repetition_penalty(logits, torch.tensor([10]), 2.0))
    finite = torch.randn(5000, generator=torch.Generator().manual_seed(5)) * 3
    for seed in range(20):
        params = SamplingParams(temperature=0.7, top_p=0.9 if seed % 2 else 1.0, repetition_penalty=1.1)
        picks = [sample(finite, params, make_generator(seed), seen, penalty_fn=fn).token_id
                 for fn in (runner.penalized, None)]
        assert picks[0] == picks[1]


def test_top_logits_of_a_batch_equal_each_rows(tokenizer):
    runner = make_runner(tiny_model(tokenizer).model, "fp32")
    logits = torch.randn(3, 5000) * 4
    assert [runner.top_logits(row, 5) for row in logits] == runner.top_logits_batch(logits, 5)


def test_top_logits_pass_over_nans(tokenizer):
    """A NaN never wins, nor hides a larger logit that shares its vector lane (8 apart in a stretch)."""
    runner = make_runner(tiny_model(tokenizer).model, "fp32")
    logits = torch.randn(5000) * 4
    logits[10:15] = torch.arange(50.0, 55.0)  # a top five before the stretch [640, 704), whose others cannot enter it
    logits[640:704] = -100.0
    logits[[640, 3000, 4999]] = float("nan")
    logits[648] = 100.0
    ids, values, lse = runner.top_logits(logits, 5)
    expected_ids, expected_values, _ = top_logits(logits.nan_to_num(nan=float("-inf")), 5)
    assert ids == expected_ids and ids[0] == 648 and values == pytest.approx(expected_values)


def test_top_logits_refuse_logits_that_are_all_nan(tokenizer):
    runner = make_runner(tiny_model(tokenizer).model, "fp32")
    with pytest.raises(ValueError, match="no finite logits"):
        runner.top_logits(torch.full((100,), float("nan")), 5)


def test_native_decode_refuses_a_full_cache(tokenizer):
    runner = make_runner(tiny_model(tokenizer).model, "fp32")
    cache = runner.new_cache(16)  # one block
    runner.forward(torch.arange(1, 17), 0, cache)
    with pytest.raises(ValueError, match="KV cache full: 17 tokens do not fit in 16"):
        runner.forward(torch.tensor([5]), 16, cache)


def test_without_a_compiler_decode_runs_pytorch_ops(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler"):
        build_library(tmp_path)
    loaded = tiny_model(tokenizer)
    with pytest.warns(UserWarning, match="decode runs PyTorch ops"):
        runner = LeanLlama(loaded.model, "fp32", cache_dir=str(tmp_path))
    assert "PyTorch ops" == runner.decode_path
    finished = Engine(loaded, EngineConfig(), runner=runner).generate(
        [{"role": "user", "content": "Hi"}], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    assert 5 == finished.metrics.num_generated_tokens


def test_switched_off_by_environment(tokenizer, monkeypatch):
    monkeypatch.setenv("PHASESCOPE_FUSED_DECODE", "0")
    assert "PyTorch ops" == make_runner(tiny_model(tokenizer).model, "int8").decode_path


@pytest.fixture
def no_model(monkeypatch):
    """Engine.from_config does what it does before the model loads, then raises ModelError."""
    def load_model(*args, **kwargs):
        raise ModelError("not loaded in this test")

    monkeypatch.setattr("engine.engine.load_model", load_model)


def test_library_is_built_once_per_source_and_cpu_begun_before_the_model_loads(tmp_path, no_model, caplog):
    """Engine.from_config begins the compile (8 s) before it loads the model (a first start converts it
    meanwhile: 33 s without, 22 s with, when the conversion took 20 s); build_library waits for that compile."""
    with pytest.raises(ModelError):
        Engine.from_config(EngineConfig(cache_dir=str(tmp_path)))
    assert [tmp_path / "kernels"] == [target.parent for target in fused._BUILDS]  # under way
    with caplog.at_level(logging.INFO, logger="engine"):
        first = build_library(tmp_path)
    assert "compiling the native decode step once" in caplog.text  # what is left of it is waited for
    assert not fused._BUILDS
    built_ns = os.stat(first).st_mtime_ns
    assert first == build_library(tmp_path) and built_ns == os.stat(first).st_mtime_ns
    assert [first.name] == [p.name for p in (tmp_path / "kernels").iterdir()]  # no leftovers from the build


@pytest.mark.parametrize("config, environment", [
    (EngineConfig(precision="fp16"), {}), (EngineConfig(tensor_parallel=2), {}),
    (EngineConfig(), {"PHASESCOPE_FUSED_DECODE": "0"}), (EngineConfig(), {"CXX": "no-such-compiler"})])
def test_no_compile_is_begun_where_the_native_step_will_not_decode(tmp_path, monkeypatch, no_model, config,
                                                                     environment):
    """Half precision and tensor parallelism decode with PyTorch ops: a compile for them would take a core
    for 8 s of the load for nothing. Without a compiler nothing is begun, and nothing is said yet."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ModelError):
        Engine.from_config(dataclasses.replace(config, cache_dir=str(tmp_path)))
    assert not fused._BUILDS and not (tmp_path / "kernels").exists()


def test_a_cache_folder_that_cannot_be_written_falls_back(tokenizer, tmp_path):
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="decode runs PyTorch ops"):
        runner = LeanLlama(tiny_model(tokenizer).model, "int8", cache_dir=str(blocker))
    assert "PyTorch ops" == runner.decode_path


def test_split_kv_attention_equals_the_unsplit_one_at_long_context(tokenizer):
    """Flash Decoding: a sequence longer than a chunk (512 positions) attended in chunks by several
    tasks, merged by the log-sum-exp rule, gives the unsplit logits within float tolerance; a short
    sequence in the same batch gets exactly its unsplit result."""
    loaded = tiny_model(tokenizer, num_heads=6, num_kv_heads=2, hidden=384, max_positions=2048)  # head dim 64
    lean = LeanLlama(loaded.model, precision="fp32")
    pool = lean.new_pool(64_000_000)
    long_seq, short_seq = pool.allocate([], 1400), pool.allocate([], 64)
    lean.forward(torch.arange(1300) % 900 + 5, 0, long_seq)
    lean.forward(torch.arange(40) + 7, 0, short_seq)
    results = {}
    for split in (False, True):
        lean.fused.split_kv = split
        results[split] = lean.decode([11, 12], [1300, 40], [long_seq, short_seq])
        long_seq.truncate(1300)
        short_seq.truncate(40)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-4, atol=1e-4)
    assert torch.equal(results[True][1], results[False][1])
    # the explain mode's capture of the long sequence stays split: its weights come from the chunks
    captured = {}
    for split in (False, True):
        lean.fused.split_kv = split
        logits, weights, _ = lean.decode([11, 12], [1300, 40], [long_seq, short_seq], capture=0)
        captured[split] = logits, weights
        long_seq.truncate(1300)
        short_seq.truncate(40)
    torch.testing.assert_close(captured[True][0], results[True], rtol=0, atol=0)  # the same split step
    torch.testing.assert_close(captured[True][1], captured[False][1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(captured[True][1].sum(-1), torch.ones(captured[True][1].shape[:2]))


@pytest.mark.parametrize("native", [True, False])
def test_compressed_kv_caches_take_fewer_bytes_and_keep_the_logits_close(tokenizer, native):
    """--kv-dtype fp16 and int8: keys and values stored rounded (fp16) or as int8 with a scale per head
    and position, read back as fp32 by the native prefill attention and decode step and by the PyTorch
    ops alike: fewer bytes, logits within a tolerance of the fp32 cache's."""
    loaded = tiny_model(tokenizer, num_heads=6, num_kv_heads=2, hidden=384)  # head dim 64: native kernels
    lean = LeanLlama(loaded.model, precision="fp32")
    results = {}
    for dtype in (torch.float32, torch.float16, torch.int8):
        pool = lean.new_pool(16_000_000, kv_dtype=dtype)
        sequence = pool.allocate([], 80)
        with (nullcontext() if native else lean.pytorch_decode()):
            prefill = lean.forward(torch.arange(60) % 500 + 3, 0, sequence)
            decode = lean.decode([42, 43], [60, 61], [sequence, sequence])  # two positions: the second sees the first
        results[dtype] = (prefill, decode, pool)
    reference = results[torch.float32]
    for dtype, tolerance, shrink in ((torch.float16, 2e-3, 2.0), (torch.int8, 3e-2, 256 / 68)):
        prefill, decode, pool = results[dtype]
        assert reference[2].bytes_per_token / pool.bytes_per_token == pytest.approx(shrink)
        torch.testing.assert_close(prefill, reference[0], rtol=0, atol=tolerance)
        torch.testing.assert_close(decode, reference[1], rtol=0, atol=tolerance)
        assert not torch.equal(decode, reference[1])  # the cache really was compressed


def test_the_native_step_and_pytorch_store_int8_keys_alike(tokenizer):
    """The same int8 rows and scales from the native kernels and from PyTorch's quantize_rows (layer 0:
    later layers' keys already differ by the two attention implementations' rounding)."""
    loaded = tiny_model(tokenizer, num_heads=6, num_kv_heads=2, hidden=384)
    lean = LeanLlama(loaded.model, precision="fp32")
    pools = []
    for native in (True, False):
        pool = lean.new_pool(4_000_000, kv_dtype=torch.int8)
        sequence = pool.allocate([], 40)
        with (nullcontext() if native else lean.pytorch_decode()):
            lean.forward(torch.arange(30) % 500 + 3, 0, sequence)
        pools.append(pool.kv[0, :, :, :30])
    assert torch.equal(pools[0], pools[1])


def test_engine_reports_the_kv_formats_bytes(tokenizer):
    engine = Engine(tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256),
                    EngineConfig(precision="fp32", kv_dtype="fp16"))
    assert engine.pool.kv.dtype == torch.float16
    assert engine.info.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2  # K and V, 2 layers, 2 KV heads, 64 dims, 2 B
    finished = engine.generate(user("Hi"), SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    assert finished.metrics.kv_bytes == finished.metrics.kv_tokens * engine.info.kv_bytes_per_token


def test_bind_threads_gives_each_of_the_forwards_threads_a_cpu_and_an_engine_without_it_frees_them(tiny):
    """--bind-threads: the stepping thread's OpenMP team (the native step's; PyTorch's ops share it) each on
    a CPU of its own; an engine without the switch sharing the forward (variant) frees them again, and the
    tokens are the same either way."""
    from app.lab.threads import bound_threads

    if len(os.sched_getaffinity(0)) < 2 or torch.get_num_threads() < 2:
        pytest.skip("one CPU: every thread is on one CPU already")
    before = bound_threads()
    engine = Engine(tiny, EngineConfig(precision="fp32", prefix_caching=False))
    bound = engine.variant(bind_threads=True)

    def greedy(e):
        request = e.new_request_from_ids(list(range(5, 45)), SamplingParams(max_new_tokens=8, temperature=0,
                                                                           ignore_eos=True))
        list(e.run(request))
        return request.generated_ids

    try:
        on = greedy(bound)
        assert bound_threads() >= before + torch.get_num_threads()
        off = greedy(engine)
        assert bound_threads() == before
    finally:
        engine.runner.fused.bind_threads(False)
    assert on == off


def test_bind_threads_without_the_native_step_is_refused_in_one_line(tokenizer, tmp_path):
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("")
    loaded = tiny_model(tokenizer)
    with pytest.warns(UserWarning, match="decode runs PyTorch ops"):
        runner = LeanLlama(loaded.model, "int8", cache_dir=str(blocker))
    with pytest.raises(ValueError, match="--bind-threads binds the native decode step's threads: it needs that step"):
        Engine(loaded, EngineConfig(bind_threads=True), runner=runner)
