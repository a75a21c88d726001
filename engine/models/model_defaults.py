"""The sampling a model's makers recommend, and the one a chat starts with.

A Hugging Face model folder may carry a generation_config.json beside its weights with the temperature,
top-p, top-k and repetition penalty its makers chose (Qwen2.5-Instruct: 0.7, 0.8, 20, 1.05; Llama 3.1
Instruct: 0.6 and 0.9). vLLM starts every request from them (`--generation-config auto`); so do the page's
chat settings, `phasescope chat`, `generate` and the API here, for whatever a user or a request does not
set. A GGUF file carries them as general.sampling.* metadata. Read before torch or the model loads; the
bundled model (a GGUF file) names none.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..config import CHAT_REPETITION_PENALTY, CHAT_TOP_P, SamplingParams
from .gguf_file import gguf_metadata

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# what `generate` uses where neither its options nor the model say: SamplingParams' own (the API keeps OpenAI's)
PLAIN_SAMPLING = {key: getattr(SamplingParams(), key) for key in SAMPLING_KEYS}
# what a chat (the page, `phasescope chat`) starts with where the model says nothing: see engine/config.py
CHAT_SAMPLING = {**PLAIN_SAMPLING, "top_p": CHAT_TOP_P, "repetition_penalty": CHAT_REPETITION_PENALTY}


def model_sampling(source: str | None) -> dict[str, float | int]:
    """The sampling settings a model sets: a folder's generation_config.json, or a .gguf file's
    general.sampling.* metadata (convert_hf_to_gguf copies them there from that file). Only those of
    SAMPLING_KEYS that it gives as numbers SamplingParams accepts (others are left out, as if unset). {}
    for the bundled model, or a model that sets none."""
    if source is None:
        return {}
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        raw = {GGUF_SAMPLING[key]: value for key, value in gguf_metadata(path, GGUF_SAMPLING).items()}
    else:
        raw = generation_config(path)
    return _usable(raw)


def generation_config(folder: Path) -> dict:
    """A model folder's generation_config.json; {} where there is none, or it is not a JSON object (the
    loader says what else is wrong with the folder)."""
    try:
        raw = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _usable(raw: dict) -> dict[str, float | int]:
    chosen: dict[str, float | int] = {}
    for key in SAMPLING_KEYS:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key == "top_k":
            if value != int(value):
                continue
            value = int(value)
        else:  # a GGUF file's float32: 0.95 reads 0.949999988...
            value = float(f"{value:.6g}")
        try:
            SamplingParams(**{key: value})
        except ValueError:
            continue
        chosen[key] = value
    return chosen


# a GGUF file's sampling metadata (gguf-py's Keys.General.SAMPLING_*), and the names here; llama.cpp's
# repeat penalty is the same rule over the last 64 tokens
GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.penalty_repeat": "repetition_penalty"}
def sampling_origin(source: str | None) -> str:
    """Where model_sampling reads a model's settings: "gguf" (its metadata) or "json" (generation_config.json)."""
    return "gguf" if source is not None and Path(source).suffix.lower() == ".gguf" else "json"


def sampling_defaults(source: str | None, chat: bool = False, given: dict | None = None) -> dict[str, float | int]:
    """Temperature, top-p, top-k and repetition penalty to start from: the model's where it sets them,
    else a chat's (chat=True) or the plain ones. given: model_sampling(source), where the caller has read
    it already (a GGUF file's header is not walked twice)."""
    return {**(CHAT_SAMPLING if chat else PLAIN_SAMPLING), **(model_sampling(source) if given is None else given)}
