"""Ways to shorten the compiled decode step's replay on a GPU, measured against it (issue 17).

On an H200 the compiled graph replays in 1.25 ms at batch 1 (718-744 tok/s; 1,000 is the target). This
script, for a session lent a GPU after scripts/gpu_check.py, times tg128 at batch 1 for (--only):

- sdpa: the compiled step as it is (SDPA over keys and values gathered from the pool);
- sums: attention written as sums (q.k, softmax, weights.v), which Inductor can fuse with the gathers
  from the pool instead of copying the keys and values out for SDPA (sums-fp32: its fp32 greedy
  tokens against the eager ops');
- gemv: the matrix products written as sums too, which Inductor fuses with the norms, SiLU and
  residual adds around them (gemv-fp32: greedy tokens; gemv-tuned: with coordinate-descent tuning);
- autotune: mode="max-autotune-no-cudagraphs" (Triton matrix products with their epilogues fused,
  chosen by timing; minutes of compilation), with the faster of sdpa and sums;
- batch8: each variant measured also at batch 8 (its (8, 256) graph compiled, ~30 s more each).

Each variant's kernels are profiled (kernels_*.txt), its tg128 step split into its parts (step_parts),
for the time a step spends outside its replay, and its tg128 run again with the next token taken on the
device (device_greedy_tg128): every replay queued before any token is read back (the ceiling of a
multi-step decode), and each token read while the next step runs (an asynchronous decode). Measured
2026-12-04 18:06 (docs/measurements.md): replay 1.257 ms (sdpa), 1.119 (sums), 0.929 (gemv); tg128
unchanged.

    python scripts/gpu_variants.py [--out DIR] [--only sdpa,gemv,...]   # default sdpa,sums,sums-fp32,autotune

~3 minutes for the default; `--device cpu --layers 2` checks it here. Writes $OUT/gpu_variants.json after
each section. A variant that wins moves into engine/kernels/cuda_graphs.py.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as check  # noqa: E402
from engine.kernels.cuda_graphs import StaticDecode  # noqa: E402

SDPA_ATTENTION = StaticDecode._attention


def attention_as_sums(self: StaticDecode, index: int, qkv: torch.Tensor, key_slots: torch.Tensor,
                      visible: torch.Tensor) -> torch.Tensor:
    """StaticDecode._attention without SDPA: scores and the weighted sum as reductions over the pool's
    gathered rows, which Inductor can fuse with the gathers."""
    m = self.model
    batch, heads, kv_heads, head_dim = qkv.shape[0], m.num_heads, m.num_kv_heads, m.head_dim
    q, keys, values = self._queries_and_pool(index, qkv, key_slots)  # [B, H, D], [B, KV, L, D] twice
    q = q.reshape(batch, kv_heads, heads // kv_heads, 1, head_dim).float()
    scores = (q * keys[:, :, None].float()).sum(-1) / math.sqrt(head_dim)  # [B, KV, G, L]
    weights = torch.softmax(scores.masked_fill(~visible.view(batch, 1, 1, -1), float("-inf")), dim=-1)
    out = (weights[..., None] * values[:, :, None].float()).sum(-2)  # [B, KV, G, D]
    return out.to(qkv.dtype).reshape(batch, heads * head_dim)


def gemv(linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x) for a few rows x [B, K] as a sum over K, which Inductor writes as a reduction kernel that
    can take the ops before and after it in (a norm's scale, SiLU(gate) * up, the residual add), where
    cuBLAS runs a matrix product of ~3.8 us at one row for any of these sizes."""
    y = (x[:, None, :].float() * linear.weight[None].float()).sum(-1)
    return (y if linear.bias is None else y + linear.bias.float()).to(x.dtype)


def forward_with_gemv(self: StaticDecode) -> None:
    """StaticDecode._forward with every matrix product a gemv."""
    m, inputs = self.model, self.inputs
    key_slots, visible = inputs.key_slots(), inputs.visible()
    x = F.embedding(inputs.ids, m.embed)
    for index, layer in enumerate(m.layers):
        h = F.rms_norm(x, x.shape[-1:], layer.attn_norm, m.eps)
        x = x + gemv(layer.o, self._attention(index, gemv(layer.qkv, h), key_slots, visible))
        h = F.rms_norm(x, x.shape[-1:], layer.mlp_norm, m.eps)
        gate, up = gemv(layer.gate_up, h).chunk(2, dim=-1)
        x = x + gemv(layer.down, F.silu(gate) * up)
    self.logits.copy_(gemv(m.lm_head, F.rms_norm(x, x.shape[-1:], m.final_norm, m.eps)))


SDPA_FORWARD = StaticDecode._forward


def prefilled(lean, pool, steps: int) -> tuple[int, object]:
    """A reply's 16-token prompt prefilled in a cache with room for `steps` more tokens (every block of
    the reply allocated), and its first token."""
    cache = pool.allocate([], 16 + steps + 1)
    return int(lean.forward(check.prompts(1, 16)[0].to(check.DEVICE), 0, cache).argmax()), cache


def step_parts(lean, pool, steps: int = 127) -> dict:
    """Where a tg128 step's time goes, ms per step: the engine's decode call until it returns (the inputs
    filled, the graph launched, the logits' copy queued), then until the GPU is done, then the argmax
    read back; and one replay waited for alone (replay_ms's are back to back). In run 1 and 2 of
    2026-12-04 18:06 a step with attention as sums took ~0.4 ms more than its replay, SDPA's ~0.1."""
    token, cache = prefilled(lean, pool, steps)
    parts = [0.0, 0.0, 0.0]
    for step in range(steps):
        start = time.perf_counter()
        logits = lean.decode([token], [16 + step], [cache])
        returned = time.perf_counter()
        check.synchronize()
        done = time.perf_counter()
        token = logits.argmax(-1).tolist()[0]
        for i, took in enumerate((returned - start, done - returned, time.perf_counter() - done)):
            parts[i] += took
    pool.free(cache)
    names = ("decode call, ms", "then the GPU, ms", "argmax read, ms")
    found = {name: round(1000 * took / steps, 3) for name, took in zip(names, parts)}
    if check.DEVICE == "cuda":
        graph = lean.graphs.pools[pool].graphs[(1, 256)]
        found["one replay waited for, ms"] = round(
            1000 * check.seconds(lambda: [(graph.replay(), check.synchronize()) for _ in range(100)]) / 100, 3)
    return found


def device_greedy_tg128(lean, pool, steps: int = 127) -> dict:
    """tg128 at batch 1 with the next token taken on the device: after each replay a second small graph
    takes the step's argmax as the next token and moves the position, rotary position and pool slot on by
    one, so that the host never waits for a token before it queues the next step. Two ways: every step
    queued before any token is read back (the ceiling of a multi-step decode), and each token read while
    the next step runs (an asynchronous decode, as vLLM's asynchronous scheduling runs it: what an engine
    that streams each token would get). tok/s of each, and whether their tokens are lean_greedy's."""
    expected = check.lean_greedy(lean, pool, 1, 16, steps + 1)[0][0]
    cuda = check.DEVICE == "cuda"
    tokens = torch.zeros(steps, dtype=torch.long, device=check.DEVICE)
    count = torch.zeros(1, dtype=torch.long, device=check.DEVICE)
    advance_graph = None

    def begin():
        """A reply's prompt prefilled and its first decode step run, through the engine: the (1, 256) step's
        inputs are then filled for position 16, with every block of the reply in its block table."""
        first, cache = prefilled(lean, pool, steps)
        lean.decode([first], [16], [cache])
        count.zero_()
        return first, cache

    first, cache = begin()
    state = lean.graphs.pools[pool]
    step, graph = state.steps[(1, 256)], state.graphs.get((1, 256))
    inputs, size = step.inputs, pool.block_size

    @torch.inference_mode()  # the inputs were made in it, by the engine's decode
    def advance() -> None:
        token = step.logits[:1].argmax(-1)
        tokens.index_copy_(0, count, token)
        count.add_(1)
        inputs.ids.copy_(token)
        inputs.positions.add_(1)
        inputs.rope.add_(1)
        inputs.slot.copy_(inputs.block_table[0, inputs.positions // size] * size + inputs.positions % size)

    if cuda:
        advance()  # a warm-up (kernels loaded before the capture), which moves the inputs on: begin again
        advance_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(advance_graph):  # recorded, not run
            advance()
        pool.free(cache)
        first, cache = begin()
        side, host = torch.cuda.Stream(), torch.zeros(1, dtype=torch.long, pin_memory=True)
    run_step = graph.replay if cuda else step.run
    run_advance = advance_graph.replay if cuda else advance

    def read(index: int, ready) -> int:
        """Token `index`, once the advance that wrote it is done, copied on a stream of its own: the step
        queued after that advance keeps running."""
        if not cuda:
            return int(tokens[index])
        side.wait_event(ready)
        with torch.cuda.stream(side):
            host.copy_(tokens[index:index + 1], non_blocking=True)
        side.synchronize()
        return int(host[0])

    def queued() -> None:
        for _ in range(steps - 1):
            run_advance()
            run_step()
        run_advance()

    def each_read() -> list[int]:
        found = []
        for index in range(steps):
            run_advance()
            ready = torch.cuda.Event() if cuda else None
            if cuda:
                ready.record()
            if index < steps - 1:
                run_step()
            found.append(read(index, ready))
        return found

    figures = {}
    elapsed = check.seconds(queued)
    figures["tg128 batch 1, token on the device"] = round((steps - 1) / elapsed, 1)
    figures["token on the device, same tokens"] = [first] + tokens.tolist() == expected
    pool.free(cache)
    first, cache = begin()
    streamed = []
    elapsed = check.seconds(lambda: streamed.extend(each_read()))
    figures["tg128 batch 1, token on the device, each read"] = round((steps - 1) / elapsed, 1)
    figures["each read, same tokens"] = [first] + streamed == expected
    pool.free(cache)
    return figures


def compiled(model, precision: str, attention, mode: str | None, forward=SDPA_FORWARD, tuning: bool = False):
    """A lean path whose graphs compile its steps with this attention, forward and torch.compile mode
    (tuning: Inductor's coordinate-descent tuning of each kernel's block sizes)."""
    torch._dynamo.reset()  # the code compiled for the previous variant would otherwise serve this one
    StaticDecode._attention, StaticDecode._forward = attention, forward
    torch._inductor.config.coordinate_descent_tuning = tuning
    lean = check.lean_model(model, precision, compile=True)
    if mode is not None:
        lean.graphs.compile_options = {"mode": mode}
    return lean


VARIANTS = ("sdpa", "sums", "sums-fp32", "autotune", "gemv", "gemv-tuned", "gemv-fp32", "batch8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--only", default=",".join(VARIANTS[:4]), help=f"some of {','.join(VARIANTS)}")
    args = parser.parse_args()
    only = args.only.split(",")
    if unknown := set(only) - set(VARIANTS):  # at once: a typo would spend a lent GPU's minutes on nothing
        parser.error(f"--only: no variant {', '.join(sorted(unknown))}; choose from {','.join(VARIANTS)}")
    check.DEVICE = args.device
    report = check.Report(Path(args.out), "gpu_variants.json")
    model = check.random_model(torch.bfloat16, args.layers)

    def measure(name: str, attention, mode: str | None = None, **options) -> float:
        with report.section(name):
            lean = compiled(model, "auto", attention, mode, **options)
            pool = lean.new_pool(1 << 30)
            tokens_per_s, replay = check.graph_tg128(lean, pool, 1)
            report[name] = {"tg128 batch 1": round(tokens_per_s, 1)}  # each figure kept as soon as it is had
            if replay is not None:
                report[name]["replay ms"] = round(replay, 3)
            report[name].update(step_parts(lean, pool))
            if replay is not None and mode is None:
                step = lean.graphs.pools[pool].steps[(1, 256)]
                file = "kernels_" + name.replace(" ", "_").replace(",", "").replace("+", "") + ".txt"
                report[name].update(check.profile_kernels(lambda: [step.run() for _ in range(10)], 10,
                                                          report.out / file))
            report[name].update(device_greedy_tg128(lean, pool))
            if "batch8" in only:  # each row of a batch reads the weights again where the products are sums
                tokens_per_s, replay = check.graph_tg128(lean, pool, 8)
                report[name]["tg128 batch 8"] = round(tokens_per_s, 1)
                if replay is not None:
                    report[name]["batch 8, replay ms"] = round(replay, 3)
        return report.get(name, {}).get("replay ms") or float("inf")

    def greedy(name: str, attention, forward=SDPA_FORWARD) -> None:
        with report.section(name):
            report[name] = check.greedy_against_eager(
                compiled(check.random_model(torch.float32, args.layers), "fp32", attention, None, forward))

    sdpa = sums = float("inf")
    if "sdpa" in only:
        sdpa = measure("compiled, SDPA", SDPA_ATTENTION)
    if "sums" in only:
        sums = measure("compiled, attention as sums", attention_as_sums)
    if "sums-fp32" in only:
        greedy("fp32 greedy tokens, attention as sums vs PyTorch ops", attention_as_sums)
    if "gemv" in only:
        measure("compiled, attention as sums + gemv", attention_as_sums, forward=forward_with_gemv)
    if "gemv-fp32" in only:
        greedy("fp32 greedy tokens, attention as sums + gemv vs PyTorch ops", attention_as_sums, forward_with_gemv)
    if "gemv-tuned" in only:
        measure("compiled, attention as sums + gemv, tuned", attention_as_sums, forward=forward_with_gemv, tuning=True)
    if "autotune" in only:  # last: its compilation takes the longest
        faster = ("attention as sums", attention_as_sums) if sums < sdpa else ("SDPA", SDPA_ATTENTION)
        measure(f"compiled, {faster[0]}, max-autotune-no-cudagraphs", faster[1], "max-autotune-no-cudagraphs")
    StaticDecode._attention, StaticDecode._forward = SDPA_ATTENTION, SDPA_FORWARD


if __name__ == "__main__":
    main()
