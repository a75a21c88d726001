"""Tensor parallelism: two gloo processes on loopback give one rank's logits and greedy tokens, through
prefill, batched decode and the prefix cache; the split is as even as whole heads allow; the workers
are gone after close."""
from __future__ import annotations

import multiprocessing
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model, user
from engine import Engine, EngineConfig, SamplingParams
from engine.llama import LeanLlama
from engine.tensor_parallel import split_plan, start


def test_the_split_is_as_even_as_whole_heads_allow():
    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    assert split_plan(smollm2, 2) == [(range(0, 5), range(0, 2), range(0, 768)),  # KV head 1 held by both
                                      (range(5, 9), range(1, 3), range(768, 1536))]
    assert split_plan(smollm2, 3) == [(range(0, 3), range(0, 1), range(0, 512)),
                                      (range(3, 6), range(1, 2), range(512, 1024)),
                                      (range(6, 9), range(2, 3), range(1024, 1536))]
    with pytest.raises(ValueError, match="1 to 9 ranks"):
        split_plan(smollm2, 10)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a bias on q, k and v
def test_two_ranks_give_one_ranks_logits(tokenizer, kind):
    # 3 KV heads: one on both ranks
    loaded = tiny_model(tokenizer, kind, num_heads=6, num_kv_heads=3, hidden=192, max_positions=512)
    reference = LeanLlama(loaded.model, "fp32")
    ids = torch.arange(300) % 700 + 11
    runner = start(loaded.model, "fp32", 2, threads=1)
    halves = []  # (position, tokens) of each prefill rank 0 ran as two halves, overlapping their all-reduces
    in_halves = runner._forward_halves

    def noted(ids, segment, need_logits):
        halves.append(segment[1:])
        return in_halves(ids, segment, need_logits)

    runner._forward_halves = noted
    try:
        for attention in ("sdpa", "eager"):
            reference.attention = runner.attention = attention
            expected_cache, cache = reference.new_cache(310), runner.new_cache(310)
            for start_at, end in ((0, 12), (12, 30), (30, 300)):  # three prefill chunks, the last in halves
                expected = reference.forward(ids[start_at:end], start_at, expected_cache)
                got = runner.forward(ids[start_at:end], start_at, cache)
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            with reference.pytorch_decode():
                expected = reference.decode([5, 6], [300, 301], [expected_cache, expected_cache])  # two rows
            comm_before = runner.comm_ms
            torch.testing.assert_close(runner.decode([5, 6], [300, 301], [cache, cache]), expected,
                                       rtol=1e-4, atol=1e-4)
            assert runner.comm_ms > comm_before  # the decode step's all-reduces were timed
        assert halves == [(30, 270), (30, 270)]
    finally:
        runner.close()
    assert not any(worker.is_alive() for worker in multiprocessing.active_children())


def test_the_engine_on_two_ranks_decodes_the_same_tokens(tokenizer):
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)
    sampling = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    conversation = user("Tell me about the sea.")
    one = Engine(loaded, EngineConfig(precision="fp32"))
    split = Engine(loaded, EngineConfig(precision="fp32", tensor_parallel=2))
    try:
        assert split.info.decode_path == "PyTorch ops, tensor parallel x2 (gloo)"
        first = one.generate(conversation, sampling).text
        events = list(split.stream(conversation, sampling))
        assert events[-1].text == first
        assert all(e.comm_ms > 0 for e in events if e.type == "PrefillChunk" or e.type == "DecodeStep" and e.step)
        # a second turn takes the first's blocks from each rank's cache, and two replies decode in one batch
        follow_up = conversation + [{"role": "assistant", "content": first}, user("And the mountains?")[0]]
        requests = [split.new_request(follow_up, sampling), split.new_request(conversation, sampling)]
        finished = split.run_all(requests)
        assert requests[0].num_cached_tokens > 0
        assert [f.text for f in finished] == [one.generate(follow_up, sampling).text, first]
    finally:
        split.close()
    assert not multiprocessing.active_children()


def test_phasescope_generate_runs_the_bundled_model_on_two_ranks(bundled):
    args = ["--prompt", "What is the capital of France?", "--temperature", "0", "--max-new-tokens", "12"]
    run = [sys.executable, "-m", "app.cli", "generate", *args]
    split = subprocess.run([*run, "--tensor-parallel", "2"], capture_output=True, text=True, timeout=300)
    one = subprocess.run([*run, "--precision", "fp32"], capture_output=True, text=True, timeout=300)
    assert split.returncode == 0, split.stderr
    assert split.stdout == one.stdout and "Paris" in split.stdout
    assert "tensor parallel: prefill" in split.stderr and "in all-reduce" in split.stderr
