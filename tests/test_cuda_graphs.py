"""The CUDA-graph decode step's bookkeeping (engine/kernels/cuda_graphs.py), on the CPU: its buckets, the static
step it records against the eager decode, padding rows, and when the eager ops run instead. Capture and
replay themselves need a GPU (scripts/gpu_check.py)."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model
from engine.kernels.cuda_graphs import BATCH_BUCKETS, GraphDecode, bucket, context_buckets, why_not
from engine.kv_pool import KVPool
from engine.models.llama import LeanLlama

PROMPT = "Prefill reads the prompt; decode writes the reply."


def test_buckets():
    assert [bucket(n, BATCH_BUCKETS) for n in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert bucket(33, BATCH_BUCKETS) is None
    # a bucket pads fewer rows than a block of 16 holds: each padding row writes a slot of its own
    assert max(bucket(n, BATCH_BUCKETS) - n for n in range(1, 33)) < 16
    assert context_buckets(8192, 16) == (256, 512, 1024, 2048, 4096, 8192)
    assert context_buckets(1000, 16) == (256, 512, 1008)  # whole blocks, the window last
    assert context_buckets(100, 64) == (128,)


def test_graphs_only_where_they_can_run():
    pool = KVPool(2, 2, 16, 4, 16, torch.float32)
    gpu = SimpleNamespace(device=torch.device("cuda"), kv_head_of=None)
    assert why_not(gpu, pool) is None
    assert "CUDA" in why_not(SimpleNamespace(device=torch.device("cpu"), kv_head_of=None), pool)
    assert why_not(SimpleNamespace(device=torch.device("cpu"), kv_head_of=None), pool, capture=False) is None
    assert "int8" in why_not(gpu, KVPool(2, 2, 16, 4, 16, torch.int8))
    assert "uneven" in why_not(SimpleNamespace(device=torch.device("cuda"), kv_head_of=torch.tensor([0, 0, 1])), pool)


def test_a_cpu_model_decodes_without_graphs(tokenizer):
    lean = LeanLlama(tiny_model(tokenizer).model, "fp32")
    assert lean.graphs is None and lean.decode_path == "fused C++"


def test_the_scratch_block_is_the_pools_last_and_leaves_its_capacity():
    pool = KVPool(2, 2, 16, 4, 16, torch.float32)
    assert pool.take_scratch_block() == 3
    assert pool.num_blocks == 3 and pool.capacity_tokens == 48 and pool.usage().num_blocks == 3
    assert [pool.allocate([], 16).block_ids for _ in range(3)] == [[0], [1], [2]]
    assert pool.allocate([], 16) is None  # the scratch block is no sequence's
    full = KVPool(2, 2, 16, 2, 16, torch.float32)
    full.allocate([], 32)
    assert full.take_scratch_block() is None


def prefilled(lean: LeanLlama, prompts: list[torch.Tensor], steps: int):
    pool = lean.new_pool(4 << 20, block_size=16, prefix_caching=False)
    pool.kv.fill_(float("nan"))  # what uninitialized memory may hold: a masked position must not read it
    caches = [pool.allocate([], len(ids) + steps) for ids in prompts]
    for ids, cache in zip(prompts, caches):
        lean.forward(ids, 0, cache)
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # rotary in complex pairs / in halves
def test_static_step_gives_the_eager_decodes_tokens_and_cache(tokenizer, dtype):
    """Three sequences of different lengths, one past the first context bucket (256 tokens), decoded
    together for 8 steps: padded to a batch of 4, every row reads only its own positions."""
    model = tiny_model(tokenizer, max_positions=1024).model.to(dtype)
    lean = LeanLlama(model, "auto")
    lean.fused = None  # the eager PyTorch ops as the reference
    prompts = [torch.tensor(tokenizer(PROMPT * repeat)["input_ids"]) for repeat in (1, 3, 25)]
    assert len(prompts[-1]) > 256
    steps = 8
    eager, static = prefilled(lean, prompts, steps), prefilled(lean, prompts, steps)
    graphs = GraphDecode(lean, capture=False)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    tokens = [int(ids[-1]) for ids in prompts]
    for step in range(steps):
        rows = range(3) if step < steps - 1 else range(2)  # the last step without the long one
        positions = [len(prompts[i]) + step for i in rows]
        expected = lean.decode(tokens[:len(rows)], positions, [eager[i] for i in rows])
        got = graphs(tokens[:len(rows)], positions, [static[i] for i in rows])
        assert got is not None and got.shape == expected.shape
        assert (got.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
        tokens = expected.argmax(-1).tolist()
    state = graphs.pools[static[0].pool]
    assert set(state.steps) == {(4, 512), (2, 256)}  # the longest sequence sets the bucket
    padding = state.steps[(4, 512)].inputs  # its fourth row pads the batch of three, in the scratch block
    assert padding.slot[3] == state.scratch_slot and (padding.key_slots()[3] == state.scratch_slot).all()
    assert padding.visible()[3].sum() == 1
    padding.fill([], [], [], state.scratch_slot)  # a capture's inputs: every row pads, each in its own slot
    assert padding.slot.tolist() == [state.scratch_slot + i for i in range(4)]
    for a, b in zip(eager, static):
        assert a.num_tokens == b.num_tokens
        slots = [block * 16 + i for block in a.block_ids for i in range(16)][:a.num_tokens]
        kv_a, kv_b = a.pool.kv[:, :, :, slots].float(), b.pool.kv[:, :, :, slots].float()
        assert (kv_a - kv_b).abs().max() <= tolerance * kv_a.abs().max()


def test_steps_no_bucket_holds_take_the_eager_ops(tokenizer):
    lean = LeanLlama(tiny_model(tokenizer, max_positions=1024).model, "fp32")
    lean.fused = None
    graphs = GraphDecode(lean, capture=False)
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    caches = prefilled(lean, [ids] * 33, 1)
    assert graphs([1] * 33, [len(ids)] * 33, caches) is None  # a batch beyond the largest bucket
    assert graphs([1] * 32, [len(ids)] * 32, caches[:32]) is not None
    assert graphs([1], [len(lean.cos)], caches[:1]) is None  # past the rotary tables
    tight = lean.new_cache(len(ids) + 1)  # a pool with no block to spare for padding rows
    lean.forward(ids, 0, tight)
    assert graphs([1], [len(ids)], [tight]) is None


def test_the_engine_decodes_through_the_static_step_as_through_the_eager_ops(tokenizer):
    """Requests joining and leaving a batch (1 to 5 rows, padded to 2, 4 and 8) through the scheduler: the
    same greedy tokens as each alone on the eager ops, and the pool's gauge one block smaller."""
    from engine import Engine, EngineConfig
    from test_scheduler import PROMPTS, alone, run_staggered

    engine = Engine(tiny_model(tokenizer), EngineConfig(precision="fp32", prefix_caching=False))
    runner, blocks = engine.runner, engine.pool.num_blocks
    runner.fused = None
    max_new = [6 + 3 * (i % 3) for i in range(5)]
    expected = [alone(engine, p, n) for p, n in zip(PROMPTS[:5], max_new)]
    runner.graphs = GraphDecode(runner, capture=False)
    _, requests = run_staggered(engine, PROMPTS[:5], max_new, [2 * i for i in range(5)])
    assert expected == [r.generated_ids for r in requests]
    assert {batch for batch, _ in runner.graphs.pools[engine.pool].steps} >= {2, 4}
    assert engine.pool.usage().num_blocks == blocks - 1


def test_each_pool_has_its_own_steps_and_one_scratch_block(tokenizer):
    """Two pools over one model (an engine's variants) in turn: each sets one block aside, once, and keeps
    its steps; a pool that goes away takes its steps with it."""
    lean = LeanLlama(tiny_model(tokenizer).model, "fp32")
    lean.fused = None
    graphs = GraphDecode(lean, capture=False)
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    first, second = prefilled(lean, [ids], 4), prefilled(lean, [ids], 4)
    blocks = first[0].pool.num_blocks
    for step in range(4):
        for caches in (first, second):
            assert graphs([1], [len(ids) + step], caches) is not None
    assert [c[0].pool.num_blocks for c in (first, second)] == [blocks - 1] * 2
    assert len(graphs.pools) == 2 and all(set(p.steps) == {(1, 256)} for p in graphs.pools.values())
    del first
    gc.collect()
    assert len(graphs.pools) == 1


def test_compiling_the_decode_step_needs_cuda_graphs_and_is_said_in_the_model_line(tokenizer):
    from engine import Engine, EngineConfig

    with pytest.raises(ValueError, match="CUDA device"):
        Engine(tiny_model(tokenizer), EngineConfig(precision="fp32", compile_decode=True))
    loaded = tiny_model(tokenizer)
    runner = LeanLlama(loaded.model, "fp32")
    runner.fused, runner.graphs = None, GraphDecode(runner, capture=False)  # as on a GPU, uncaptured
    engine = Engine(loaded, EngineConfig(precision="fp32", compile_decode=True), runner=runner)
    assert runner.graphs.compile and engine.info.decode_path == "CUDA graph + torch.compile"
    assert engine.variant(kv_dtype="fp16").info.decode_path == "CUDA graph + torch.compile"  # the Lab's variants


def test_the_compiled_static_step_gives_the_eager_decodes_tokens_and_writes_the_pool(tokenizer):
    """torch.compile of the static step (on the CPU: Inductor's C++ in place of Triton): the same greedy
    tokens as the eager decode, its keys and values written into the pool itself, and no recompilation
    from one step to the next (the bucket's shapes are fixed)."""
    import torch._dynamo

    lean = LeanLlama(tiny_model(tokenizer).model, "fp32")
    lean.fused = None
    graphs = GraphDecode(lean, capture=False, compile=True)
    prompts = [torch.tensor(tokenizer(PROMPT * repeat)["input_ids"]) for repeat in (1, 2)]
    eager, static = prefilled(lean, prompts, 6), prefilled(lean, prompts, 6)
    torch._dynamo.reset()
    tokens = [int(ids[-1]) for ids in prompts]
    with torch._dynamo.config.patch(error_on_recompile=False):
        for step in range(6):
            positions = [len(ids) + step for ids in prompts]
            expected = lean.decode(tokens, positions, eager)
            assert graphs(tokens, positions, static).argmax(-1).tolist() == expected.argmax(-1).tolist()
            tokens = expected.argmax(-1).tolist()
            if step == 0:
                torch._dynamo.config.error_on_recompile = True  # compiled once, at the first step
    for a, b in zip(eager, static):
        slots = [block * 16 + i for block in a.block_ids for i in range(16)][:a.num_tokens]
        assert torch.allclose(a.pool.kv[:, :, :, slots], b.pool.kv[:, :, :, slots], atol=1e-5)


def test_the_eager_ops_on_cuda_leave_cudnn_attention_out():
    """cuDNN's attention builds a plan for each new shape (each prompt length, each decode step's context):
    measured on an H200, the eager decode made 14 tok/s with it. The eager ops on CUDA use the others."""
    with LeanLlama._sdpa_kernels(SimpleNamespace(device=torch.device("cuda"))):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
