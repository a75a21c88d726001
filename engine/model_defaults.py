"""The sampling a model's makers recommend, and the one a chat starts with.

A Hugging Face model folder may carry a generation_config.json beside its weights with the temperature,
top-p, top-k and repetition penalty its makers chose (Qwen2.5-Instruct: 0.7, 0.8, 20, 1.05; Llama 3.1
Instruct: 0.6 and 0.9). vLLM starts every request from them (`--generation-config auto`); so do the page's
chat settings, `phasescope chat`, `generate` and the API here, for whatever a user or a request does not
set. Plain JSON, read before torch or the model loads. The bundled model (a GGUF file) names none.
"""
from __future__ import annotations

import json
from pathlib import Path

from .config import CHAT_REPETITION_PENALTY, CHAT_TOP_P, SamplingParams

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# what `generate` and the API use where neither the request nor the model says (vLLM's, transformers')
PLAIN_SAMPLING = {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
# what a chat (the page, `phasescope chat`) starts with where the model says nothing: see engine/config.py
CHAT_SAMPLING = {**PLAIN_SAMPLING, "top_p": CHAT_TOP_P, "repetition_penalty": CHAT_REPETITION_PENALTY}


def model_sampling(source: str | None) -> dict[str, float | int]:
    """The sampling settings a model folder's generation_config.json sets: those of SAMPLING_KEYS that it
    gives as numbers SamplingParams accepts (others are left out, as if unset). {} for the bundled model,
    a .gguf file, or a folder without the file."""
    if source is None:
        return {}
    try:
        config = json.loads((Path(source).expanduser() / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no such folder or file, or not JSON: the loader says what is wrong
        return {}
    chosen: dict[str, float | int] = {}
    for key in SAMPLING_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key == "top_k":
            if value != int(value):
                continue
            value = int(value)
        try:
            SamplingParams(**{key: value})
        except ValueError:
            continue
        chosen[key] = value
    return chosen


def sampling_defaults(source: str | None, chat: bool = False) -> dict[str, float | int]:
    """Temperature, top-p, top-k and repetition penalty to start from: the model's where it sets them,
    else a chat's (chat=True) or the plain ones."""
    return {**(CHAT_SAMPLING if chat else PLAIN_SAMPLING), **model_sampling(source)}
