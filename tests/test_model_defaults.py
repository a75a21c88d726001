"""A model's own sampling settings (its generation_config.json): read, and taken where nothing else sets them."""
from __future__ import annotations

import io
import json
import struct

import pytest

from engine import model_sampling, sampling_defaults
from engine.models.model_defaults import CHAT_SAMPLING, PLAIN_SAMPLING

QWEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "bos_token_id": 151643, "eos_token_id": [151645, 151643], "transformers_version": "4.37.0"}


def _folder(tmp_path, content) -> str:
    (tmp_path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return str(tmp_path)


def test_what_the_model_sets_is_read_and_what_it_leaves_out_comes_from_the_command(tmp_path):
    folder = _folder(tmp_path, QWEN)
    assert {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05} == model_sampling(folder)
    assert model_sampling(folder) == sampling_defaults(folder) == sampling_defaults(folder, chat=True)
    folder = _folder(tmp_path, {"temperature": 0.6, "top_k": 40.0})  # Llama-style: some of them; 40.0 is 40
    assert {**CHAT_SAMPLING, "temperature": 0.6, "top_k": 40} == sampling_defaults(folder, chat=True)
    assert {**PLAIN_SAMPLING, "temperature": 0.6, "top_k": 40} == sampling_defaults(folder)
    assert isinstance(model_sampling(folder)["top_k"], int)


@pytest.mark.parametrize("content", [
    {"temperature": "hot", "top_p": 0, "top_k": 2.5, "repetition_penalty": True},  # none usable: as if unset
    {"temperature": -1, "top_p": 1.5, "top_k": -3, "repetition_penalty": None},
    {"eos_token_id": 2},  # no sampling in it
    "[0.7]", "not json", "",
])
def test_a_file_that_sets_nothing_usable_changes_nothing(tmp_path, content):
    folder = _folder(tmp_path, content)
    assert {} == model_sampling(folder)
    assert CHAT_SAMPLING == sampling_defaults(folder, chat=True) and PLAIN_SAMPLING == sampling_defaults(folder)


def test_the_bundled_model_and_missing_files_set_nothing(tmp_path):
    from engine import default_model_path

    assert {} == model_sampling(None) == model_sampling(str(tmp_path / "model.gguf")) == model_sampling(
        str(tmp_path / "missing")) == model_sampling(str(default_model_path()))  # its header has no such keys
    assert CHAT_SAMPLING == sampling_defaults(None, chat=True)


def _gguf(path, write_keys) -> str:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "<|im_end|>"])  # arrays before the keys: skipped
    write_keys(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_gguf_files_sampling_metadata_is_read_from_its_header(tmp_path):
    """convert_hf_to_gguf copies generation_config.json's settings into general.sampling.* (float32)."""
    def keys(writer):
        writer.add_float32("general.sampling.temp", 0.6)
        writer.add_float32("general.sampling.top_p", 0.95)
        writer.add_int32("general.sampling.top_k", 20)
        writer.add_float32("general.sampling.penalty_repeat", 1.05)
        writer.add_float32("general.sampling.min_p", 0.05)  # not a setting here: left out

    path = _gguf(tmp_path / "model.gguf", keys)
    assert {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05} == model_sampling(path)
    data = (tmp_path / "model.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:60])  # a file cut short: nothing, no error
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert {} == model_sampling(str(tmp_path / "cut.gguf")) == model_sampling(str(tmp_path / "empty.gguf"))
    nested = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9) \
        + struct.pack("<IQ", 9, 1) * 100_000  # an array of an array of ... (a crafted file)
    (tmp_path / "nested.gguf").write_bytes(nested)
    assert {} == model_sampling(str(tmp_path / "nested.gguf"))


def test_the_api_takes_the_models_settings_for_what_a_request_leaves_out():
    from app.serve.protocol import ChatRequest, CompletionRequest

    model = {"temperature": 0.2, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    messages = [{"role": "user", "content": "Hi"}]
    chosen = ChatRequest(messages=messages, temperature=1.0).sampling(None, 64, model)
    assert (1.0, 0.8, 20, 1.05) == (chosen.temperature, chosen.top_p, chosen.top_k, chosen.repetition_penalty)
    plain = ChatRequest(messages=messages).sampling(None, 64)  # a model that sets none: OpenAI's defaults
    assert (1.0, 1.0, 0, 1.0) == (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty)
    completion = CompletionRequest(prompt="Hi", top_k=-1, echo=True, logprobs=1).sampling(None, 64, model)
    assert (0.2, 0, True) == (completion.temperature, completion.top_k, completion.prompt_logprobs)  # -1: off


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer):
    """A tiny random Llama saved as a Hugging Face folder, with a generation_config.json of its own."""
    from conftest import tiny_model

    folder = tmp_path_factory.mktemp("model")
    tiny_model(tokenizer).model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_folder_model_ends_where_its_generation_config_says(model_folder):
    from engine import Engine, EngineConfig

    config = json.loads((model_folder / "config.json").read_text())
    ends = [config["eos_token_id"] + 1, config["eos_token_id"] + 2]  # e.g. an instruct model's end of turn
    (model_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    engine = Engine.from_config(EngineConfig(model=str(model_folder), precision="fp32"))
    assert engine.runner.name == "lean-llama"  # read by the direct loader, as transformers reads it
    assert set(ends) <= engine.eos_ids


def test_generate_and_chat_start_from_the_models_settings(model_folder, capsys, tmp_path, monkeypatch):
    from app.cli import main

    (model_folder / "generation_config.json").write_text(json.dumps({"temperature": 0, "top_k": 20}))
    replies = []
    for _ in range(2):  # a random model's next token is near uniform: two sampled replies would differ
        assert 0 == main(["generate", "--model", str(model_folder), "--prompt", "Hi", "--max-new-tokens", "12"])
        out, err = capsys.readouterr()
        assert "from the model's generation_config.json: temperature=0, top_k=20" in err
        replies.append(out)
    assert replies[0] == replies[1]
    assert 0 == main(["generate", "--model", str(model_folder), "--prompt", "Hi", "--max-new-tokens", "1",
                      "--temperature", "0.5"])
    assert "generation_config.json: top_k=20\n" in capsys.readouterr().err  # what the options set is theirs
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n/bye\n"))
    assert 0 == main(["chat", "--model", str(model_folder), "--db", str(tmp_path / "h.db"), "--max-new-tokens", "4"])
    assert "from the model's generation_config.json: temperature=0, top_k=20" in capsys.readouterr().err
    from app.history.store import Store

    store = Store.open(tmp_path / "h.db")
    settings = json.loads(store.sessions()[0]["settings"])
    assert (0, 20, 0.9, 1.1) == (settings["temperature"], settings["top_k"], settings["top_p"],
                                 settings["repetition_penalty"])  # the rest a chat's


def test_the_pages_note_says_where_the_settings_come_from_in_either_language():
    from app.ui.chat_tab import _model_sampling_note

    note = _model_sampling_note("en", {"temperature": 0.6, "top_k": 20}, "gguf")
    assert note.startswith("This model's GGUF metadata (`general.sampling.*`) sets `temperature=0.6`, `top_k=20`:")
    assert "`generation_config.json` 设定了 `top_p=0.8`" in _model_sampling_note("zh", {"top_p": 0.8}, "json")
    assert "" == _model_sampling_note("en", {}, "json")  # the bundled model: no note


def test_the_api_of_a_model_with_settings_takes_them_for_what_a_request_leaves_out(model_folder):
    from starlette.testclient import TestClient

    from app.serve.api import create_api
    from app.ui.session import EngineThread
    from engine import Engine, EngineConfig

    (model_folder / "generation_config.json").write_text(json.dumps({"temperature": 0}))
    thread = EngineThread().start()
    try:
        engine = thread.call(lambda: Engine.from_config(EngineConfig(model=str(model_folder), precision="fp32")))
        thread.serve(engine)
        with TestClient(create_api(engine)) as client:
            def reply(**fields) -> str:
                body = {"prompt": "Hi", "max_tokens": 12, "ignore_eos": True, **fields}
                return client.post("/v1/completions", json=body).json()["choices"][0]["text"]

            greedy = reply()  # the model's temperature 0: the same tokens every time
            assert greedy == reply() == reply(seed=7)
            assert greedy != reply(temperature=1.0, seed=7)  # a random model's sampled tokens: near uniform
    finally:
        thread.stop()
