"""Prefill-side switches: the attention implementations (the native kernel, PyTorch's fused SDPA and the
textbook's eager form) give the same logits, whole or in chunks, on each supported architecture."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model, user
from engine import Engine, EngineConfig, SamplingParams
from engine.models.llama import LeanLlama, eager_attention, score_matrix_bytes
from engine.models.quantize import Int8Linear, int8_available


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])  # qwen2: a bias on q, k and v
@pytest.mark.parametrize("chunks", [[40], [16, 24], [7, 9, 24]])
def test_attention_implementations_agree(tokenizer, kind, chunks):
    loaded = tiny_model(tokenizer, kind, num_heads=6, num_kv_heads=2, hidden=384)  # GQA, head dim 64
    lean = LeanLlama(loaded.model, precision="fp32")
    ids = torch.arange(40) % 700 + 11
    results = {}
    for attention in ("auto", "sdpa", "eager"):
        lean.attention = attention
        cache, pos = lean.new_cache(64), 0
        for size in chunks:
            logits = lean.forward(ids[pos:pos + size], pos, cache)
            pos += size
        results[attention] = torch.cat([logits, lean.decode([5], [40], [cache])[0]])
    torch.testing.assert_close(results["sdpa"], results["auto"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results["eager"], results["auto"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_long_prompts_mlp_in_row_blocks_gives_the_same_logits(tokenizer, monkeypatch, precision):
    """On CPU a prompt longer than MLP_ROWS goes through each MLP MLP_ROWS rows at a time."""
    lean = LeanLlama(tiny_model(tokenizer, hidden=256).model, precision=precision)
    ids = torch.arange(40) % 700 + 11
    logits = {}
    for rows in (4096, 7):  # the whole prompt at once; blocks of 7 rows and a last one of 5
        monkeypatch.setattr("engine.models.llama.MLP_ROWS", rows)
        logits[rows] = lean.forward(ids, 0, lean.new_cache(64), every_row=True)
    assert logits[7].shape == (40, len(tokenizer))
    torch.testing.assert_close(logits[7], logits[4096], rtol=1e-5, atol=1e-5)


def test_eager_attention_is_softmax_of_the_materialized_scores():
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)  # 4 query heads over 2 KV heads
    mask = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)  # query i sees keys 0..i+2
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0),
                                                                attn_mask=mask)
    torch.testing.assert_close(eager_attention(q, k, v, mask), expected)
    assert score_matrix_bytes(9, 2048, 2048) == 9 * 2048 * 2048 * 4  # 151 MB per layer at 2,048 tokens


def test_the_engine_switch_gives_the_same_greedy_tokens(tokenizer):
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)
    sampling = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    tokens = {attention: Engine(loaded, EngineConfig(precision="fp32", attention=attention)).generate(
        user("Tell me about the sea."), sampling).text for attention in ("auto", "sdpa", "eager")}
    assert tokens["auto"] == tokens["sdpa"] == tokens["eager"]
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="flash")


def test_fbgemms_int8_matmul_is_close_to_fp32(tokenizer):
    """The fallback where the native library is not built. Without AVX-512 VNNI, FBGEMM's 16-bit sums
    saturate on full-range activations: it gave noise on a Zen 3 until they were quantized to 7 bits."""
    if not int8_available():
        pytest.skip("this torch has no FBGEMM")
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)
    linear = LeanLlama(loaded.model, precision="int8").layers[0].gate_up
    linear.use_kernel(None)
    torch.manual_seed(0)
    x = torch.rand(11, 256) + 1  # activations near the top of the 8-bit range, where the sums saturate
    rows, scales = linear.rows(), linear.native_layout()[1]
    exact = x @ (rows.float() * scales[:, None]).T
    assert linear.runs_on == "FBGEMM"
    error = ((linear(x) - exact).norm() / exact.norm()).item()
    assert error < 0.01, error  # 0.3 % measured with 7-bit activations; 3.9 % when they saturated


def _check_native_int8_matmul(linear, n: int) -> None:
    """linear over n tokens: the quantized values multiplied out, and each token's row exactly what it
    gets alone (a decode step's row)."""
    assert linear.runs_on == "native" and linear._packed is None  # no FBGEMM copy of the weights
    torch.manual_seed(0)
    inputs = linear.input_features
    x = torch.randn(n, inputs) * torch.linspace(0.1, 30, inputs)  # an outlier column, as real activations have
    y = linear(x)
    # the same quantized values multiplied out in float64: x per row and block of 64, the weights per row
    rows, scales = linear.rows(), linear.native_layout()[1]
    blocks = x.double().view(n, -1, 64)
    top = blocks.abs().amax(-1, keepdim=True)
    x_q = torch.where(top > 0, blocks * (127 / top), 0.0).round()  # round half to even, as the kernel does
    expected = torch.einsum("nkb,okb,nk->no", x_q, rows.double().view(rows.shape[0], -1, 64), (top / 127)[..., 0])
    torch.testing.assert_close(y.double(), expected * scales.double(), rtol=1e-5, atol=1e-4)
    alone = [linear(x[i:i + 1])[0] for i in range(n)]
    assert all(torch.equal(y[i], alone[i]) for i in range(n))
    assert all(torch.equal(row, alone[i]) for i, row in enumerate(linear(x[:11])))


def test_the_native_int8_matmul_is_the_decode_steps_arithmetic(tokenizer):
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)
    lean = LeanLlama(loaded.model, precision="int8")
    if lean.fused is None:
        pytest.skip("the native library is not built here")
    # two chunks of tokens (at most 128 each, AVX-512), tiles of 6 tokens and every smaller last tile
    # (150 = 128 + 22: 2 and 4 left over; 11 = 6 + 5), a thread's last tile of one row group
    _check_native_int8_matmul(lean.layers[0].gate_up, 150)
    # 40 rows: with AVX-512 a thread's rows in groups of 16 (the second thread's 8, half a group), or the
    # rows as they are elsewhere
    torch.manual_seed(1)
    odd = Int8Linear(torch.randn(40, 128))
    if lean.fused.int8_row_group:
        lean.fused.pack(odd)
    odd.use_kernel(lean.fused.linear_int8)
    _check_native_int8_matmul(odd, 23)


def test_packed_int8_rows_unpack_to_the_rows(tokenizer):
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)
    lean = LeanLlama(loaded.model, precision="int8")
    if lean.fused is None or not lean.fused.int8_row_group:
        pytest.skip("this build reads the int8 rows as they are")
    torch.manual_seed(2)
    weight = torch.randn(40, 128)
    linear, plain = Int8Linear(weight), Int8Linear(weight)
    lean.fused.pack(linear)
    packed = linear.native_layout()[0]
    assert packed.dtype == torch.uint8 and packed.numel() == 48 * 128  # 3 groups of 16 rows, the last padded
    assert torch.equal(linear.rows(), plain.rows())
    # FBGEMM's copy is made from the unpacked rows: the same results as from the plain ones
    if int8_available():
        x = torch.randn(5, 128)
        assert torch.equal(linear(x), plain(x))


def test_the_int8_cache_keeps_rows_packed_and_reads_them_on_any_build(tmp_path):
    from engine.models.quantize import Int8Cache

    torch.manual_seed(3)
    weights = [torch.randn(40, 128), torch.randn(64, 64)]
    first = Int8Cache(tmp_path / "w.safetensors")
    made = [first(w) for w in weights]
    rows = [linear.rows().clone() for linear in made]
    group = 16  # as an AVX-512 build packs them (FusedDecode.pack), done here by hand for any machine
    for linear in made:
        out, inputs = linear.output_features, linear.input_features
        packed = torch.zeros(-(-out // group) * group, inputs, dtype=torch.int16)
        packed[:out] = linear.rows().to(torch.int16)
        packed = (packed + 128).to(torch.uint8).view(-1, group, inputs // 4, 4).permute(0, 2, 1, 3).reshape(-1)
        linear.use_packed_rows(packed.contiguous(), group)
        assert torch.equal(linear.rows(), rows[made.index(linear)])
    first.save()  # quantized now: written, packed
    again = Int8Cache(tmp_path / "w.safetensors")
    read = [again.cached(tuple(w.shape)) for w in weights]
    assert [linear.row_group for linear in read] == [group, group]  # read packed: nothing to pack at load
    assert all(torch.equal(linear.rows(), r) for linear, r in zip(read, rows))
    mtime = (tmp_path / "w.safetensors").stat().st_mtime_ns
    again.save()
    assert (tmp_path / "w.safetensors").stat().st_mtime_ns == mtime  # as the file holds them: not rewritten
    read[1].use_plain_rows()  # a build that reads plain rows (FusedDecode without AVX-512), or FBGEMM
    assert read[1].row_group == 0 and torch.equal(read[1].native_layout()[0], rows[1])
    again.save()  # held otherwise than the file: written so
    third = Int8Cache(tmp_path / "w.safetensors")
    assert [third.cached(tuple(w.shape)).row_group for w in weights] == [group, 0]
    assert Int8Cache(tmp_path / "w.safetensors").cached((40, 64)) is None  # another shape: made anew


@pytest.mark.model
def test_bundled_int8_prefill_has_the_decode_steps_quality(bundled):
    from app.bench.extras import prefill_quality
    from engine.models.hf_runner import make_runner

    reference, quantized = make_runner(bundled.model, "fp32"), make_runner(bundled.model, "int8")
    quality = prefill_quality(reference, quantized, bundled.tokenizer)
    assert quality["top1_agreement"] >= 0.88, quality  # measured 0.902 (FBGEMM's per-tensor scales: 0.518)
    assert quality["mean_kl_nats"] <= 0.025, quality  # measured 0.018 (FBGEMM: 0.776)
