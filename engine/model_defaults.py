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
import mmap
import struct
from pathlib import Path

from .config import CHAT_REPETITION_PENALTY, CHAT_TOP_P, SamplingParams

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
# GGUF's value types: the fixed-size ones (struct formats), 8 a string, 9 an array
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(path: Path, wanted) -> dict:
    """The numbers under the wanted keys of a GGUF file's header, read as far as they are found: a few
    milliseconds where the gguf package's reader takes seconds (it reads every tensor's description and
    the tokenizer's arrays into numpy). {} for a file it cannot read."""
    found: dict = {}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as header:
            if header[:4] != b"GGUF" or struct.unpack_from("<I", header, 4)[0] < 2:  # version 1: 32-bit counts
                return {}
            at, (_, count) = 24, struct.unpack_from("<QQ", header, 8)
            for _ in range(count):
                (size,) = struct.unpack_from("<Q", header, at)
                key = bytes(header[at + 8:at + 8 + size]).decode("utf-8", "replace")
                (kind,) = struct.unpack_from("<I", header, at + 8 + size)
                value, at = _gguf_value(header, kind, at + 12 + size)
                if key in wanted:
                    found[key] = value
                    if len(found) == len(wanted):
                        break
    except (OSError, ValueError, struct.error, RecursionError):  # not there, empty (mmap), cut short, not
        return {}  # GGUF, or arrays nested past Python's stack
    return found


def _gguf_value(header, kind: int, at: int) -> tuple[object, int]:
    """A value at an offset, and the offset after it (strings and arrays are skipped: None)."""
    if kind in _GGUF_SCALARS:
        return struct.unpack_from(_GGUF_SCALARS[kind], header, at)[0], at + struct.calcsize(_GGUF_SCALARS[kind])
    if kind == 8:
        return None, at + 8 + struct.unpack_from("<Q", header, at)[0]
    if kind == 9:
        item, count = struct.unpack_from("<IQ", header, at)
        at += 12
        if item in _GGUF_SCALARS:
            return None, at + count * struct.calcsize(_GGUF_SCALARS[item])
        for _ in range(count):  # strings (a tokenizer's vocabulary) or arrays
            _, at = _gguf_value(header, item, at)
        return None, at
    raise ValueError(f"unknown GGUF value type {kind}")


def sampling_origin(source: str | None) -> str:
    """Where model_sampling reads a model's settings: "gguf" (its metadata) or "json" (generation_config.json)."""
    return "gguf" if source is not None and Path(source).suffix.lower() == ".gguf" else "json"


def sampling_defaults(source: str | None, chat: bool = False, given: dict | None = None) -> dict[str, float | int]:
    """Temperature, top-p, top-k and repetition penalty to start from: the model's where it sets them,
    else a chat's (chat=True) or the plain ones. given: model_sampling(source), where the caller has read
    it already (a GGUF file's header is not walked twice)."""
    return {**(CHAT_SAMPLING if chat else PLAIN_SAMPLING), **(model_sampling(source) if given is None else given)}
