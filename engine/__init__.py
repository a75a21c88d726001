"""PhaseScope's engine: runs a model as observable prefill and decode steps.

The app reaches the engine only through the names below. The engine never imports the UI, the
charts or the store.

What the app reads and sends (configuration, requests, events, errors, model and pool info) is plain
data that imports no torch; the machinery behind Engine does, and is imported on first use of its names
(PEP 562), so that the app can serve its page while torch and the model load.

Where the two phases are:
- prefill: Engine.prefill (engine.py) runs a prompt chunk through LeanLlama.forward (models/llama.py);
- decode: Engine.decode_step runs one token of every sequence in the batch through LeanLlama.decode,
  which hands the whole step to the native library (kernels/fused.py, kernels/csrc/decode_step.cpp)
  where it is built;
- Engine.step (schedule -> run -> postprocess) chooses which requests take which (scheduler.py), and
  the KV cache they read and write is kv_pool.py.
"""
from __future__ import annotations

import importlib

from .config import CHAT_REPETITION_PENALTY, CHAT_TOP_P, SWITCHES, EngineConfig, Limits, SamplingParams
from .errors import EngineBusy, KVPoolTooSmall, ModelError, NotEnoughMemory, QueueFull
from .events import (FORWARD_STAGES, DecodeStep, Event, Finished, FirstToken, Hook, PrefillChunk, PromptToken,
                     Speculation, Started, TopToken, WAKE)
from .info import ModelInfo, PoolUsage
from .metrics import RequestMetrics, percentiles, session_summary
from .models.model_defaults import model_sampling, sampling_defaults, sampling_origin
from .prompt import PromptTooLong, check_messages, render_prompt, reply_message, valid_text
from .request import Request, Status
from .text import IncrementalDetokenizer
from .tokenizer import token_bytes

_WITH_TORCH = {  # name: its module, imported when the name is first used
    "Engine": ".engine", "KVPool": ".kv_pool", "SequenceKV": ".kv_pool", "kv_bytes_formula": ".kv_pool",
    "LoadedModel": ".models.loader", "default_model_path": ".models.loader", "load_model": ".models.loader",
}


def __getattr__(name: str):
    if name in _WITH_TORCH:
        return getattr(importlib.import_module(_WITH_TORCH[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHAT_REPETITION_PENALTY", "CHAT_TOP_P", "FORWARD_STAGES", "DecodeStep", "Engine", "EngineBusy", "EngineConfig",
    "Event", "Finished", "FirstToken", "Hook",
    "IncrementalDetokenizer", "KVPool", "KVPoolTooSmall", "Limits", "LoadedModel", "ModelError", "ModelInfo",
    "NotEnoughMemory",
    "PoolUsage", "PrefillChunk", "PromptToken", "PromptTooLong", "QueueFull", "Request", "SequenceKV", "Speculation",
    "RequestMetrics", "SWITCHES", "SamplingParams", "Started", "Status", "TopToken", "check_messages",
    "default_model_path", "kv_bytes_formula", "load_model", "model_sampling", "percentiles", "render_prompt",
    "reply_message", "sampling_defaults", "sampling_origin", "session_summary", "token_bytes", "valid_text", "WAKE",
]
