"""PhaseScope's engine: runs a model as observable prefill and decode steps.

The app reaches the engine only through the names below. The engine never imports the UI, the
charts or the store.
"""
from .config import EngineConfig, Limits, SamplingParams
from .engine import Engine, EngineBusy, ModelInfo, QueueFull
from .prompt import PromptTooLong, check_messages, render_prompt, valid_text
from .events import (FORWARD_STAGES, DecodeStep, Event, Finished, FirstToken, Hook, PrefillChunk, Started,
                     TopToken)
from .kv_pool import KVPool, KVPoolTooSmall, PoolUsage, SequenceKV, kv_bytes_formula
from .loader import LoadedModel, ModelError, default_model_path, load_model
from .metrics import RequestMetrics, percentiles, session_summary
from .request import Request, Status

__all__ = [
    "FORWARD_STAGES", "DecodeStep", "Engine", "EngineBusy", "EngineConfig", "Event", "Finished", "FirstToken", "Hook",
    "KVPool", "KVPoolTooSmall", "Limits", "LoadedModel", "ModelError", "ModelInfo", "PoolUsage", "PrefillChunk",
    "PromptTooLong", "QueueFull", "Request", "SequenceKV",
    "RequestMetrics", "SamplingParams", "Started", "Status", "TopToken", "check_messages", "default_model_path",
    "kv_bytes_formula", "load_model", "percentiles", "render_prompt", "session_summary", "valid_text",
]
