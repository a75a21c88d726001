"""Tensor parallelism: two processes give one rank's logits and greedy tokens, through prefill, batched
decode and the prefix cache, with their all-reduces through shared memory or gloo on loopback; the
shared-memory link's sums and gathers; the split is as even as whole heads allow; the workers and the
shared-memory file are gone after close."""
from __future__ import annotations

import glob
import os
import multiprocessing
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model, user
from engine import Engine, EngineConfig, SamplingParams
from engine.models.llama import LeanLlama
from engine.shared_memory import SharedMemoryLink
from engine.tensor_parallel import split_plan, start


def _link_rank(path: str, rank: int, world: int, results) -> None:
    link = SharedMemoryLink(path, rank, world, peers_alive=lambda: True, slot_bytes=4096)
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(rank))  # 12,000 bytes: 3 pieces of a slot
    link.all_reduce(x)
    gathered = link.all_gather(torch.full((5, 300), float(rank)))
    results.put((rank, x.tolist(), [g.tolist() for g in gathered]))  # plain values: the rank exits at once


def test_the_shared_memory_link_sums_and_gathers_in_pieces():
    world = 3
    path = SharedMemoryLink.create(world, slot_bytes=4096)
    if path is None:
        pytest.skip("no shared memory here (not x86, or no room in /dev/shm)")
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=_link_rank, args=(path, rank, world, results)) for rank in range(world)]
    try:
        for process in ranks:
            process.start()
        got = dict((rank, (x, gathered)) for rank, x, gathered in (results.get(timeout=60) for _ in ranks))
    finally:
        for process in ranks:
            process.join(timeout=10)
        os.unlink(path)
    parts = [torch.randn(3, 1000, generator=torch.Generator().manual_seed(rank)) for rank in range(world)]
    expected = parts[0] + parts[1] + parts[2]  # in rank order, as every rank adds them
    for rank in range(world):
        x, gathered = got[rank]
        assert torch.equal(torch.tensor(x), expected)  # bit for bit, on every rank
        assert gathered == [torch.full((5, 300), float(r)).tolist() for r in range(world)]


def test_a_rank_waiting_for_one_that_stopped_gives_up():
    path = SharedMemoryLink.create(2, slot_bytes=4096)
    if path is None:
        pytest.skip("no shared memory here")
    try:
        link = SharedMemoryLink(path, 0, 2, peers_alive=lambda: False, slot_bytes=4096)
        with pytest.raises(RuntimeError, match="rank has stopped"):
            link.all_reduce(torch.ones(10))
    finally:
        os.unlink(path)


def test_the_split_is_as_even_as_whole_heads_allow():
    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    assert split_plan(smollm2, 2) == [(range(0, 4), range(0, 2), range(0, 768)),  # KV head 1 held by both
                                      (range(4, 9), range(1, 3), range(768, 1536))]  # rank 0 the lighter
    assert split_plan(smollm2, 3) == [(range(0, 3), range(0, 1), range(0, 512)),
                                      (range(3, 6), range(1, 2), range(512, 1024)),
                                      (range(6, 9), range(2, 3), range(1024, 1536))]
    with pytest.raises(ValueError, match="1 to 9 ranks"):
        split_plan(smollm2, 10)


@pytest.mark.parametrize("kind, link", [("llama", "shared memory"), ("qwen2", "gloo")])  # qwen2: q, k, v biases
def test_two_ranks_give_one_ranks_logits(tokenizer, monkeypatch, kind, link):
    monkeypatch.setenv("PHASESCOPE_TP_SHARED_MEMORY", "1" if link == "shared memory" else "0")
    # 3 KV heads: one on both ranks
    loaded = tiny_model(tokenizer, kind, num_heads=6, num_kv_heads=3, hidden=192, max_positions=512)
    reference = LeanLlama(loaded.model, "fp32")
    ids = torch.arange(300) % 700 + 11
    runner = start(loaded.model, "fp32", 2, threads=1)
    assert runner.decode_path.endswith(f"({link})")
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
    before = set(glob.glob("/dev/shm/phasescope-tp-*"))  # a killed run's may be there: only this one's count
    split = Engine(loaded, EngineConfig(precision="fp32", tensor_parallel=2))
    try:
        assert split.info.decode_path == "PyTorch ops, tensor parallel x2 (shared memory)"
        assert not set(glob.glob("/dev/shm/phasescope-tp-*")) - before  # every rank mapped it: the name is gone
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
        # a prompt's own logprobs (echo): every row's logits, their columns gathered from both ranks
        asked, prompt = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True), list(range(100, 140))

        def prompt_probs(engine: Engine) -> list[float]:
            events = engine.run(engine.new_request_from_ids(prompt, asked))
            return [t.prob for e in events if e.type == "PrefillChunk" for t in e.prompt_logprobs]

        assert prompt_probs(split) == pytest.approx(prompt_probs(one), rel=1e-3) and len(prompt_probs(one)) == 39
        # the Lab's experiments that time the forward's stages, or start engines of their own, say why not
        from app import lab

        assert "" == lab.cannot_run(split, "kv-cache") == lab.cannot_run(one, "stages")
        assert lab.cannot_run(split, "stages").endswith("start without --tensor-parallel.")
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
