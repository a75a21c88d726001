"""The GPU check of the decode step (issue 17): a few minutes on a lent GPU.

Random weights in SmolLM2-135M's exact shape (the bundled model's weights do not travel to the GPU
machine), on CUDA in bf16: decode tg128 at batch 1 and 8 for the lean path with CUDA graphs, with
graphs of torch.compiled steps (--compile-decode) and with the eager ops, each graph's replay timed
alone; prefill pp512; transformers' eager `generate` and its static cache with `torch.compile`. Greedy
tokens with either kind of graph against the eager ops in fp32 come first, and the kernels of an eager
decode step are profiled (kernels.txt). Prints one JSON object and writes it to $OUT/gpu_check.json (or
--out) after each section, so that a run stopped at its time limit keeps what it measured.

    python scripts/gpu_check.py [--out DIR] [--no-compile] [--lean-only]

`--device cpu --layers 2` runs the same code on the CPU in seconds (the static step run without
capture where the graphs would be), to check the script before spending device time on it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels.cuda_graphs import GraphDecode  # noqa: E402
from engine.models.llama import LeanLlama  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


DEVICE = "cuda"


def random_model(dtype: torch.dtype, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers})).eval()
    return model.to(device=DEVICE, dtype=dtype)


def lean_model(model, precision: str, compile: bool = False) -> LeanLlama:
    """The lean path over model, its graphs' steps compiled or not; on the CPU (checking this script)
    with the static step run without capture in place of the graphs, and no native step, so that the
    same Python runs as on a GPU."""
    lean = LeanLlama(model, precision)
    if DEVICE == "cpu":
        lean.fused = None
    lean.graphs = GraphDecode(lean, capture=DEVICE == "cuda", compile=compile)
    return lean


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def prompts(batch: int, length: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(100, SMOLLM2_135M["vocab_size"], (length,), generator=generator) for _ in range(batch)]


def seconds(fn) -> float:
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


@contextmanager
def without_graphs(lean: LeanLlama):
    graphs, lean.graphs = lean.graphs, None
    try:
        yield
    finally:
        lean.graphs = graphs


def lean_greedy(lean: LeanLlama, pool, batch: int, prompt_tokens: int, new_tokens: int
                ) -> tuple[list[list[int]], float]:
    """Greedy tokens of `batch` sequences decoded together, and the decode tok/s of all of them (prefill
    not counted). One pool for every call: the graphs record its address."""
    ids = prompts(batch, prompt_tokens)
    caches = [pool.allocate([], prompt_tokens + new_tokens) for _ in ids]
    tokens = [int(lean.forward(p.to(DEVICE), 0, c).argmax()) for p, c in zip(ids, caches)]
    out = [[t] for t in tokens]

    def decode():
        nonlocal tokens
        for step in range(new_tokens - 1):
            logits = lean.decode(tokens, [prompt_tokens + step] * batch, caches)
            tokens = logits.argmax(-1).tolist()
            for row, token in zip(out, tokens):
                row.append(token)

    elapsed = seconds(decode)
    for cache in caches:
        pool.free(cache)
    return out, batch * (new_tokens - 1) / elapsed


def lean_prefill(lean: LeanLlama, length: int) -> float:
    ids = prompts(1, length)[0].to(DEVICE)
    cache = lean.new_cache(length + 1)
    lean.forward(ids, 0, cache)  # warm-up
    cache = lean.new_cache(length + 1)
    return length / seconds(lambda: lean.forward(ids, 0, cache))


def hf_decode(model, batch: int, prompt_tokens: int, new_tokens: int) -> float:
    """transformers' generate: decode tok/s from the difference of a 1-token and a new_tokens run."""
    ids = torch.stack(prompts(batch, prompt_tokens)).to(DEVICE)
    kwargs = dict(do_sample=False, pad_token_id=0)

    def run(n: int) -> float:
        return seconds(lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs))

    run(2)  # warm-up (and compilation)
    run(new_tokens)
    return batch * (new_tokens - 1) / (run(new_tokens) - run(1))


def hf_prefill(model, length: int) -> float:
    ids = prompts(1, length)[0].to(DEVICE)[None]
    with torch.inference_mode():
        model(ids)  # warm-up
        return length / seconds(lambda: model(ids))


def replay_ms(lean: LeanLlama, pool, batch: int) -> float:
    """Milliseconds of one replay of the (batch, 256) graph alone: the GPU's share of a decode step, the
    rest of a step being Python and copies."""
    graph = lean.graphs.pools[pool].graphs[(batch, 256)]
    graph.replay()
    return 1000 * seconds(lambda: [graph.replay() for _ in range(100)]) / 100


def graph_tg128(lean: LeanLlama, pool, batch: int) -> tuple[float, float | None]:
    """tg128 tok/s of `batch` sequences through the graphs, after a warm-up that captures (and compiles)
    the batch's graph, and one replay of that graph alone in ms (None off CUDA)."""
    lean_greedy(lean, pool, batch, 16, 8)
    tokens_per_s = lean_greedy(lean, pool, batch, 16, 128)[1]
    return tokens_per_s, replay_ms(lean, pool, batch) if DEVICE == "cuda" else None


def greedy_against_eager(lean: LeanLlama) -> str:
    """Greedy tokens of 8 sequences (64 each) through the graphs against the eager ops'."""
    pool = lean.new_pool(1 << 30)
    graph_tokens, _ = lean_greedy(lean, pool, 8, 16, 64)
    with without_graphs(lean):
        eager_tokens, _ = lean_greedy(lean, pool, 8, 16, 64)
    same = sum(a == b for a, b in zip(graph_tokens, eager_tokens))
    return "identical" if graph_tokens == eager_tokens else f"differ ({same} of 8 sequences identical)"


def profile_kernels(run, steps: int, path: Path) -> dict:
    """The GPU kernels of run() (`steps` decode steps), their table written to path; returns kernels per
    step and their GPU time per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        synchronize()
    events = prof.key_averages()
    path.write_text(events.table(sort_by="cuda_time_total", row_limit=40) + "\n")
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernels per step": round(sum(e.count for e in kernels) / steps),
            "kernel time per step, ms": round(sum(e.device_time_total for e in kernels) / steps / 1000, 3)}


class Report(dict):
    """The figures so far, written out after each section (a run stopped at its time limit keeps them);
    a section that fails is recorded as failed and the next one runs."""

    def __init__(self, out: Path, name: str = "gpu_check.json") -> None:
        super().__init__()
        self.out, self.name, self.started = out, name, time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def section(self, name: str):
        start = time.perf_counter()
        print(f"[{start - self.started:6.1f} s] {name}", flush=True)
        try:
            yield
        except Exception as error:  # noqa: BLE001 (recorded: the other sections' figures stand)
            self.setdefault("failed", {})[name] = f"{type(error).__name__}: {error}"[:400]
            print(f"  failed: {self.get('failed')[name]}", flush=True)
        self.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
        (self.out / self.name).write_text(json.dumps(self, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--no-compile", action="store_true", help="skip transformers + torch.compile")
    parser.add_argument("--lean-only", action="store_true", help="skip transformers' figures")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to check this script")
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"], help="fewer for a check")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here")
    report = Report(Path(args.out))
    report["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    report["torch"] = torch.__version__

    graphs = {False: "lean, CUDA graphs", True: "lean, CUDA graphs + torch.compile"}
    # correctness first: greedy tokens of 8 sequences, graphs against the eager ops, in fp32
    for compiled in (False, True):
        name = f"fp32 greedy tokens, {graphs[compiled]} vs PyTorch ops"
        with report.section(name):
            report[name] = greedy_against_eager(lean_model(random_model(torch.float32, args.layers), "fp32", compiled))

    model = random_model(torch.bfloat16, args.layers)
    for compiled in (False, True):
        with report.section(graphs[compiled]):
            lean = lean_model(model, "auto", compiled)
            pool = lean.new_pool(1 << 30)
            report["decode_path"] = lean.decode_path
            for batch in (1, 8):
                figures = report.setdefault(f"tg128 batch {batch}", {})
                tokens_per_s, replay = graph_tg128(lean, pool, batch)
                figures[graphs[compiled]] = round(tokens_per_s, 1)
                if replay is not None:
                    figures[f"{graphs[compiled]}: replay alone, ms per step"] = round(replay, 3)
    for batch in (1, 8):
        with report.section(f"tg128 batch {batch}, PyTorch ops"), without_graphs(lean):
            report[f"tg128 batch {batch}"]["lean, PyTorch ops"] = round(lean_greedy(lean, pool, batch, 16, 128)[1], 1)
    with report.section("pp512"):
        report["pp512"] = {"lean": round(lean_prefill(lean, 512), 1)}
        if not args.lean_only:
            report["pp512"]["transformers eager"] = round(hf_prefill(model, 512), 1)
    if DEVICE == "cuda":
        with report.section("kernels of an eager decode step, batch 1"):
            with without_graphs(lean):  # the kernels a graph replays (one 16-token prefill counted with them)
                report["kernels of an eager decode step, batch 1"] = profile_kernels(
                    lambda: lean_greedy(lean, pool, 1, 16, 21), 20, report.out / "kernels.txt")
    if not args.lean_only:
        with report.section("transformers eager decode"):
            for batch in (1, 8):
                report[f"tg128 batch {batch}"]["transformers eager"] = round(hf_decode(model, batch, 16, 128), 1)
    if not (args.lean_only or args.no_compile):  # last: its compilation takes the longest
        with report.section("transformers static cache + torch.compile"):
            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward)
            report["tg128 batch 1"]["transformers static cache + torch.compile"] = round(
                hf_decode(model, 1, 16, 128), 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
