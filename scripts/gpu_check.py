"""The GPU check of the decode step (issue 17): a few minutes on a lent GPU.

Random weights in SmolLM2-135M's exact shape (the bundled model's weights do not travel to the GPU
machine), on CUDA in bf16: decode tg128 at batch 1 and 8 and prefill pp512 for the lean path with and
without CUDA graphs, beside transformers' eager `generate` and its static cache with `torch.compile`;
then greedy tokens with graphs against the eager ops in fp32. Prints one JSON object and writes it to
$OUT/gpu_check.json (or --out).

    python scripts/gpu_check.py [--out DIR] [--no-compile]

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
from engine.cuda_graphs import GraphDecode  # noqa: E402
from engine.llama import LeanLlama  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


DEVICE = "cuda"


def random_model(dtype: torch.dtype, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers})).eval()
    return model.to(device=DEVICE, dtype=dtype)


def lean_model(model, precision: str) -> LeanLlama:
    """The lean path over model; on the CPU (checking this script) with the static step run without
    capture in place of the graphs, and no native step, so that the same Python runs as on a GPU."""
    lean = LeanLlama(model, precision)
    if DEVICE == "cpu":
        lean.fused, lean.graphs = None, GraphDecode(lean, capture=False)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--no-compile", action="store_true", help="skip transformers + torch.compile")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to check this script")
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"], help="fewer for a check")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here")
    report: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__}

    model = random_model(torch.bfloat16, args.layers)
    lean = lean_model(model, "auto")
    pool = lean.new_pool(1 << 30)
    report["decode_path"] = lean.decode_path
    for batch in (1, 8):
        lean_greedy(lean, pool, batch, 16, 8)  # warm-up: captures this batch's graph
        _, graphs = lean_greedy(lean, pool, batch, 16, 128)
        with without_graphs(lean):
            _, eager = lean_greedy(lean, pool, batch, 16, 128)
        report[f"tg128 batch {batch}"] = {"lean, CUDA graphs": round(graphs, 1), "lean, PyTorch ops": round(eager, 1)}
    report["pp512"] = {"lean": round(lean_prefill(lean, 512), 1)}
    report["tg128 batch 1"]["transformers eager"] = round(hf_decode(model, 1, 16, 128), 1)
    if not args.no_compile:
        try:
            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward)
            report["tg128 batch 1"]["transformers static cache + torch.compile"] = round(hf_decode(model, 1, 16, 128), 1)
        except Exception as error:  # noqa: BLE001 (reported, not fatal: the lean figures stand)
            report["tg128 batch 1"]["transformers static cache + torch.compile"] = f"failed: {error}"[:300]
    del model, lean, pool
    if DEVICE == "cuda":
        torch.cuda.empty_cache()

    lean = lean_model(random_model(torch.float32, args.layers), "fp32")
    pool = lean.new_pool(1 << 30)
    graph_tokens, _ = lean_greedy(lean, pool, 8, 16, 64)
    with without_graphs(lean):
        eager_tokens, _ = lean_greedy(lean, pool, 8, 16, 64)
    report["fp32 greedy tokens, graphs vs PyTorch ops"] = "identical" if graph_tokens == eager_tokens else "differ"

    text = json.dumps(report, indent=2)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
