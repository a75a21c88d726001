"""The options as the engine's config, a request's sampling, and a remote endpoint; a bad one said with the
option's name."""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from .. import startup


def _options(*names: str) -> dict[str, str]:
    return {name: "--" + name.replace("_", "-") for name in names}


# the settings the engine's errors name, as the options that set them (names with an underscore only: they
# never stand for a word of the sentence); max_new_tokens is a limit's in one, a request's in the other
ENGINE_OPTIONS = {**_options("kv_cache_mb", "max_running", "draft_tokens", "kv_window", "kv_sinks",
                             "tensor_parallel", "prefill_chunk", "kv_dtype"),
                  "max_prompt_tokens": "--limit-prompt-tokens", "max_new_tokens": "--limit-new-tokens",
                  "max_waiting": "--limit-waiting", "max_message_chars": "--limit-message-chars",
                  "request_timeout_s": "--limit-request-seconds"}


SAMPLING_OPTIONS = _options("max_new_tokens", "top_p", "top_k", "repetition_penalty", "frequency_penalty",
                            "presence_penalty")


@contextmanager
def _said_as_options(options: dict[str, str]) -> Iterator[None]:
    """A ValueError that names a setting said with the option's name instead ("--kv-cache-mb must be a
    number of MB > 0", not "kv_cache_mb ...")."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(re.sub(r"\b(" + "|".join(options) + r")\b", lambda m: options[m.group(1)], str(exc))) \
            from None


def engine_config(args: argparse.Namespace):
    """The engine's settings from the options; a bad one is said with the option's name."""
    from engine import EngineConfig, Limits

    with _said_as_options(ENGINE_OPTIONS):
        limits = Limits(max_prompt_tokens=args.limit_prompt_tokens, max_new_tokens=args.limit_new_tokens,
                        max_waiting=args.limit_waiting, max_message_chars=args.limit_message_chars,
                        request_timeout_s=args.limit_request_seconds or None)
        return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, precision=args.precision,
                            limits=limits, prefill_chunk=getattr(args, "prefill_chunk", 0),
                            kv_cache_mb=args.kv_cache_mb, prefix_caching=not args.no_prefix_cache,
                            max_running=args.max_running, kv_cache=not args.no_kv_cache,
                            speculative=args.speculative, draft_tokens=args.draft_tokens, split_kv=args.split_kv,
                            kv_dtype=args.kv_dtype, kv_window=args.kv_window, kv_sinks=args.kv_sinks,
                            attention=args.attention, tensor_parallel=args.tensor_parallel,
                            compile_decode=args.compile_decode, bind_threads=args.bind_threads)


def make_engine(args: argparse.Namespace):
    from engine import Engine

    startup.settle()  # torch is imported (see app/startup.py)
    return Engine.from_config(engine_config(args))


def sampling_of(args: argparse.Namespace):
    """The options' sampling, what they leave unset from the model's own (generation_config.json, GGUF
    metadata), else the command's defaults (a chat's for `chat`); and the model's settings so taken."""
    from engine import SamplingParams, model_sampling, sampling_defaults

    given = model_sampling(args.model)
    start = sampling_defaults(args.model, chat=args.chat_sampling, given=given)
    chosen = {key: start[key] if getattr(args, key) is None else getattr(args, key) for key in start}
    taken = {key: value for key, value in given.items() if getattr(args, key) is None}
    with _said_as_options(SAMPLING_OPTIONS):
        return SamplingParams(max_new_tokens=args.max_new_tokens, **chosen, frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty, seed=args.seed, stop=tuple(args.stop)), taken


def print_model_sampling(source: str | None, taken: dict) -> None:
    """Say which settings came from the model's own (those the options left unset: sampling_of)."""
    from engine import sampling_origin

    if taken:
        origin = {"json": "generation_config.json", "gguf": "GGUF metadata"}[sampling_origin(source)]
        print(f"from the model's {origin}: " + ", ".join(f"{k}={v:g}" for k, v in taken.items()), file=sys.stderr)


def endpoint_of(args: argparse.Namespace):
    from app.remote import Endpoint, KeyRefused

    endpoint = Endpoint(args.endpoint, args.endpoint_model, args.endpoint_key)
    try:
        endpoint.resolve_model()
    except KeyRefused as exc:  # the page has a field for the key; here it is an option
        raise KeyRefused(f"{exc}: give it with --endpoint-key or PHASESCOPE_ENDPOINT_KEY") from None
    return endpoint
