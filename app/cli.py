"""The `phasescope` command: the browser app (default), one-shot generation, and a terminal chat."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .gradio_import import private_cache
from .i18n import DEFAULT as DEFAULT_LANGUAGE, LANGUAGES
from .serve.access import bare_host, port_number
from .startup import pause_collector, settle

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
# the engine's switches (EngineConfig.switches) whose flag is not their name
SWITCH_FLAGS = {"prefix_caching": "prefix-cache"}


def switch_flags(switches: dict) -> str:
    """Switches set away from their defaults as the flags that set them: `--no-kv-cache --kv-window 256`."""
    flags = []
    for name, value in switches.items():
        flag = SWITCH_FLAGS.get(name, name.replace("_", "-"))
        flags.append(f"--{flag}" if value is True else f"--no-{flag}" if value is False else f"--{flag} {value}")
    return " ".join(flags)


def setup_flags(setup: dict) -> tuple[str, str]:
    """How an engine runs (Engine.setup: a Started event's `engine`, a saved reply's) as its precision and
    the flags of its switches: ("int8", "--no-kv-cache")."""
    switches = {name: value for name, value in setup.items() if name != "precision"}
    return str(setup.get("precision")), switch_flags(switches)


def engine_line(engine) -> str:
    """What runs, for a terminal's first lines: the model, device, precision, forward path and decode step,
    and the switches set away from their defaults (a run with --no-kv-cache says so where it starts)."""
    info, (precision, flags) = engine.info, setup_flags(engine.setup)
    plain = "" if info.chat_template else ", no chat template"  # a base model: the messages joined as text
    line = f"{info.name} on {info.device} ({precision}, {info.model_path}, decode: {info.decode_path}{plain})"
    return f"{line} with {flags}" if flags else line


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("PHASESCOPE_MODEL"),
                        help="a local Hugging Face folder or .gguf file (default: bundled SmolLM2-135M-Instruct; "
                             "env PHASESCOPE_MODEL)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (see --precision)")
    parser.add_argument("--precision", default=os.environ.get("PHASESCOPE_PRECISION", "auto"),
                        help="auto (int8 on CPU where the native decode step builds), fp32, fp16, bf16 or "
                             "int8 (weights int8, lean path on CPU); env PHASESCOPE_PRECISION")
    parser.add_argument("--kv-cache-mb", type=float, help="the KV cache pool's size in MB (default: an eighth of "
                                                          "the memory, at most 2 GiB)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="prefill every prompt whole instead of reusing the KV of prefixes already in the pool")
    parser.add_argument("--max-running", type=int, default=16, help="requests decoded together at most (default 16)")
    parser.add_argument("--no-kv-cache", action="store_true",
                        help="keep no KV cache: every decode step computes the whole sequence again (the baseline "
                             "that shows why the cache exists)")
    parser.add_argument("--speculative", metavar="prompt-lookup|draft:PATH",
                        help="speculative decoding: draft tokens from earlier text (the prompt, the reply so far), "
                             "or with a smaller model with the same tokenizer, and verify them in one forward; "
                             "the output is unchanged")
    parser.add_argument("--draft-tokens", type=int, default=8, help="the most tokens drafted at once (default 8)")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "fp16", "int8"],
                        help="the KV cache's number format (auto: the activations', fp32 on CPU); fp16 halves it, "
                             "int8 (a scale per head and position) takes 68 bytes where fp32 takes 256")
    parser.add_argument("--kv-window", type=int, help="a sliding window: keep only the first --kv-sinks tokens and "
                                                      "the last N in the KV cache, which then stops growing")
    parser.add_argument("--kv-sinks", type=int, default=4, help="tokens a --kv-window always keeps (default 4)")
    parser.add_argument("--attention", default="auto", choices=["auto", "sdpa", "eager"],
                        help="prefill's attention: auto (the native kernel), sdpa (PyTorch's fused kernel) or "
                             "eager (the whole score matrix materialized)")
    parser.add_argument("--split-kv", action=argparse.BooleanOptionalAction, default=True,
                        help="Flash Decoding: cut a long sequence's attention into chunks that the threads share "
                             "(default on; --no-split-kv to compare)")
    parser.add_argument("--bind-threads", action="store_true",
                        help="each of the forward's threads on a CPU of its own: far less slowed where another "
                             "program is busy (off by default, as PyTorch and llama.cpp leave them)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="on CUDA: torch.compile each CUDA-graph decode step before it is captured (fewer "
                             "kernels: 1.5x the tokens per second on an H200, for ~25 s of compilation per batch "
                             "and context bucket)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the model over N processes (Megatron-style): each holds a slice of every "
                             "layer, joined by two all-reduces per layer (on CPU through shared memory, else "
                             "gloo); the cores are shared out")
    limits = parser.add_argument_group("limits (each refused with a one-line message)")
    limits.add_argument("--limit-prompt-tokens", type=int, metavar="N", help="prompt tokens (default: the context)")
    limits.add_argument("--limit-new-tokens", type=int, default=8192, metavar="N",
                        help="tokens one request may ask for (default 8192)")
    limits.add_argument("--limit-waiting", type=int, default=64, metavar="N",
                        help="requests waiting behind the batch; more are told to retry (default 64)")
    limits.add_argument("--limit-message-chars", type=int, default=100_000, metavar="N",
                        help="characters in one message (default 100000)")
    limits.add_argument("--limit-request-seconds", type=float, default=600.0, metavar="S",
                        help="a request still running after S seconds ends with an error (default 600; 0: none)")


def _add_sampling_options(parser: argparse.ArgumentParser, max_new_tokens: int, chat: bool = False) -> None:
    """chat: start from a chat's sampling (top-p 0.9, repetition penalty 1.1) where the model sets none."""
    from engine.model_defaults import CHAT_SAMPLING, PLAIN_SAMPLING

    start = CHAT_SAMPLING if chat else PLAIN_SAMPLING
    given = "; default: the model's own (generation_config.json, GGUF metadata), else {:g}"
    parser.set_defaults(chat_sampling=chat)
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, help="0 is greedy" + given.format(start["temperature"]))
    parser.add_argument("--top-p", type=float, help="1: off" + given.format(start["top_p"]))
    parser.add_argument("--top-k", type=int, help="0: off" + given.format(start["top_k"]))
    parser.add_argument("--repetition-penalty", type=float,
                        help="divides the logits of tokens in the prompt or the reply (1: off" +
                             given.format(start["repetition_penalty"]) + ")")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="minus this times a token's count in the reply, from its logit (-2 to 2)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="minus this from the logit of a token already in the reply (-2 to 2)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--prefill-chunk", type=int, default=0, help="prompt tokens per prefill pass (0: all)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("phasescope")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasescope", description=__doc__)
    parser.add_argument("--version", action="version", version=f"phasescope {_version()}")
    commands = parser.add_subparsers(dest="command")

    ui = commands.add_parser("ui", help="start the browser app (the default)")
    _add_model_options(ui)
    ui.add_argument("--host", default=DEFAULT_HOST, type=bare_host)
    ui.add_argument("--port", type=port_number, default=DEFAULT_PORT)
    _add_db_option(ui)
    ui.add_argument("--open", action="store_true", help="open the default browser on the app")
    _add_access_options(ui)

    generate = commands.add_parser("generate", help="answer one prompt and print the reply or its events")
    generate.add_argument("text", nargs="?", metavar="PROMPT", help="the prompt (or --prompt); - reads it from stdin")
    generate.add_argument("--prompt", help="the prompt, as PROMPT; - reads it from standard input")
    generate.add_argument("--json", action="store_true", help="print one JSON object per event")
    _add_model_options(generate)
    _add_sampling_options(generate, max_new_tokens=256)

    chat = commands.add_parser("chat", help="chat in the terminal, with a timing line after each reply")
    _add_model_options(chat)
    _add_sampling_options(chat, max_new_tokens=512, chat=True)
    _add_endpoint_options(chat)
    _add_db_option(chat)
    chat.add_argument("--session", type=int, metavar="ID",
                      help="continue a saved conversation (see `phasescope sessions`); its new turns are saved in it")

    sessions = commands.add_parser("sessions", help="list the chat sessions in the history")
    _add_db_option(sessions)
    sessions.add_argument("--search", default="", help="only sessions whose title or messages contain this")

    export = commands.add_parser("export", help="export sessions' timing logs as CSV, JSON or a Chrome trace")
    _add_db_option(export)
    scope = export.add_mutually_exclusive_group(required=True)
    scope.add_argument("--session", type=int, help="the session id (see `phasescope sessions`)")
    scope.add_argument("--all", action="store_true", help="every session")
    export.add_argument("--format", choices=["csv", "json", "trace"], required=True)
    export.add_argument("-o", "--output",
                        help="the file to write, or a folder to write it in (default: standard output)")
    export.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    bench = commands.add_parser("bench", help="prefill and decode speed of each mode vs transformers (and llama.cpp)")
    bench.add_argument("--model", default=os.environ.get("PHASESCOPE_MODEL"))
    bench.add_argument("--device", default="auto")
    bench.add_argument("--modes", default="fp32,fp16,int8", help="comma-separated precisions: fp32, fp16, bf16, int8")
    bench.add_argument("-p", "--n-prompt", help="prompt tokens for pp (default 512), or several, comma-separated, as "
                       "llama-bench's -p: the first is every other measurement's prompt, the rest measure prefill "
                       "only (with -d also at each depth, fp32 cache; and llama.cpp's), e.g. 512,2048")
    bench.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for tg (default 128)")
    bench.add_argument("-r", "--repetitions", type=int, default=3)
    bench.add_argument("--no-baseline", action="store_true", help="skip transformers' generate")
    bench.add_argument("--llama-bench", help="path to llama.cpp's llama-bench (default: found on PATH)")
    bench.add_argument("--output", choices=["md", "csv", "json"], default="md")
    bench.add_argument("--from-json", metavar="FILE", help="measure nothing: render a run saved with --output json "
                       "again, e.g. as the Markdown tables (--output md)")
    bench.add_argument("--concurrency", default="1,2,4,8",
                       help="requests decoding at once, comma-separated (default 1,2,4,8; 0: skip)")
    bench.add_argument("-d", "--depth", default="",
                       help="also decode after this many tokens in the cache, comma-separated (llama-bench's -d), "
                            "with the KV cache in fp32, fp16 and int8, e.g. 0,1024,4096")
    bench.add_argument("--quick", action="store_true", help="a smoke run: pp32 (unless -p is given), tg8, one "
                       "repetition, concurrency 1,2")
    bench.add_argument("--tensor-parallel", type=int, default=2, metavar="N",
                       help="also prefill and decode with the model split over N processes (one thread each) vs one "
                            "rank with one thread and with N threads (default 2; 0 or 1: skip)")
    _add_endpoint_options(bench)
    bench.add_argument("--requests", type=int, default=16, help="with --endpoint: requests per concurrency level")
    bench.add_argument("--request-rate", type=float, help="with --endpoint: Poisson arrivals per second (default: "
                                                         "all at once, up to the concurrency)")
    bench.add_argument("--input-words", type=int, default=100, help="with --endpoint: words per prompt (default 100)")
    bench.add_argument("--output-tokens", type=int, default=64, help="with --endpoint: tokens per reply (default 64)")
    bench.add_argument("--random-lengths", action="store_true", help="with --endpoint: prompt lengths 0.5x to 1.5x")
    bench.add_argument("--seed", type=int, help="with --endpoint: the prompts' seed (default: a new one each run, so "
                       "that a server's prefix cache does not serve an earlier run's prompts; the same seed sends two "
                       "servers the same prompts)")
    bench.add_argument("--slo", metavar="ttft:MS,tpot:MS", help="with --endpoint: goodput counts the requests "
                                                                "within these latencies")
    bench.add_argument("--png", metavar="DIR", help="with --endpoint: write the latency-throughput chart to DIR")
    bench.add_argument("--browser", action="store_true",
                       help="also decode speed streamed to a real browser (Chromium) vs the CLI, per mode")
    serve = commands.add_parser("serve", help="an OpenAI-compatible API (and /metrics) over the engine")
    serve.add_argument("--host", default=DEFAULT_HOST, type=bare_host,
                       help="the address to bind (default 127.0.0.1: this machine only; any other needs --api-key "
                            "or --insecure)")
    serve.add_argument("--port", type=port_number, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("PHASESCOPE_API_KEY"),
                       help="require Authorization: Bearer KEY on /v1 (env PHASESCOPE_API_KEY)")
    serve.add_argument("--ui", action="store_true", help="also serve the browser app at /ui")
    _add_access_options(serve)
    _add_model_options(serve)
    _add_db_option(serve)
    lab = commands.add_parser("lab", help="run an Optimization Lab experiment (or all) both ways on the same prompt")
    lab.add_argument("experiment", help="an experiment's name, or all (see `phasescope lab list`)")
    lab.add_argument("--quick", action="store_true", help="smaller sizes: each experiment in seconds")
    lab.add_argument("--prompt", help="the prompt to run (default: the experiment's own)")
    lab.add_argument("--output", choices=["md", "json"], default="md")
    lab.add_argument("--lang", choices=list(LANGUAGES), default=DEFAULT_LANGUAGE,
                     help="the report's language (a saved run shows in the page's own language)")
    lab.add_argument("--png", metavar="DIR", help="also write each figure to DIR (PNG; standalone HTML where "
                                                  "kaleido cannot draw)")
    _add_model_options(lab)
    _add_db_option(lab)
    return parser


def _add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", metavar="URL", help="measure an OpenAI-compatible server (vLLM, SGLang, "
                        "llama.cpp, Ollama, phasescope serve) instead of the local engine, e.g. http://host:8000/v1")
    parser.add_argument("--endpoint-model", metavar="NAME", help="the model to ask the endpoint for (default: the "
                                                                 "first it lists)")
    parser.add_argument("--endpoint-key", metavar="KEY", default=os.environ.get("PHASESCOPE_ENDPOINT_KEY"),
                        help="the endpoint's API key (env PHASESCOPE_ENDPOINT_KEY)")


def _endpoint(args: argparse.Namespace):
    from app.remote import Endpoint, KeyRefused

    endpoint = Endpoint(args.endpoint, args.endpoint_model, args.endpoint_key)
    try:
        endpoint.resolve_model()
    except KeyRefused as exc:  # the page has a field for the key; here it is an option
        raise KeyRefused(f"{exc}: give it with --endpoint-key or PHASESCOPE_ENDPOINT_KEY") from None
    return endpoint


def _add_access_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auth", metavar="USER:PASSWORD", help="require this login for the UI (env PHASESCOPE_AUTH)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow binding to a non-loopback address without credentials (a warning is printed)")


def _add_db_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=os.environ.get("PHASESCOPE_DB"),
                        help="history database (default ~/.local/share/phasescope/history.db; env PHASESCOPE_DB)")


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


def _engine(args: argparse.Namespace):
    from engine import Engine

    settle()  # torch is imported (see app/startup.py)
    return Engine.from_config(engine_config(args))


def _sampling(args: argparse.Namespace):
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


def _print_model_sampling(source: str | None, taken: dict) -> None:
    """Say which settings came from the model's own (those the options left unset: _sampling)."""
    from engine import sampling_origin

    if taken:
        origin = {"json": "generation_config.json", "gguf": "GGUF metadata"}[sampling_origin(source)]
        print(f"from the model's {origin}: " + ", ".join(f"{k}={v:g}" for k, v in taken.items()), file=sys.stderr)


def _conversation(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def _num(value, digits=1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def summary_line(metrics) -> str:
    """One line after a reply, in the spirit of `ollama run --verbose`."""
    return (f"prompt {metrics.num_prompt_tokens} tok (cached {metrics.num_cached_tokens}) · "
            f"TTFT {_num(metrics.ttft_ms, 0)} ms · "
            f"prefill {_num(metrics.prefill_tokens_per_s)} tok/s · decode {_num(metrics.decode_tokens_per_s)} tok/s "
            f"({metrics.num_generated_tokens} tok) · KV {metrics.kv_tokens} tok, "
            f"{metrics.kv_bytes / 1e6:.1f} MB")


def speculation_line(speculation) -> str:
    """What speculative decoding did for a reply."""
    rate = speculation.acceptance_rate
    return (f"speculative: drafted {speculation.drafted}, accepted {speculation.accepted}"
            f" ({'n/a' if rate is None else f'{100 * rate:.0f}%'}) · {_num(speculation.tokens_per_forward, 2)} "
            f"tokens per forward ({speculation.tokens} in {speculation.forwards})")


def tensor_parallel_line(events: list) -> str:
    """Where a tensor-parallel reply's forward time went: compute, or the all-reduces joining the ranks."""
    chunks = [e for e in events if e.type == "PrefillChunk"]
    steps = [e for e in events if e.type == "DecodeStep" and e.step > 0]
    prefill_ms, prefill_comm = sum(c.latency_ms for c in chunks), sum(c.comm_ms for c in chunks)
    line = f"tensor parallel: prefill {prefill_ms:,.0f} ms, {prefill_comm:,.0f} ms of it in all-reduce"
    if steps:
        step_ms, step_comm = sum(s.forward_ms for s in steps) / len(steps), sum(s.comm_ms for s in steps) / len(steps)
        line += f" · decode {step_ms:.1f} ms per step, {step_comm:.1f} ms of it in all-reduce"
    return line


def print_reply(events) -> object:
    """Print the reply's text as it streams; return the Finished event."""
    printed = ""
    for event in events:
        if event.type == "DecodeStep":
            print(event.text, end="", flush=True)
            printed += event.text
        elif event.type == "Finished":
            print(event.text[len(printed):], flush=True)  # text held back for a possible stop string
            return event
    raise RuntimeError("the engine ended without a Finished event")


def cmd_generate(args: argparse.Namespace) -> int:
    sampling, taken = _sampling(args)
    messages = _conversation(args.system) + [{"role": "user", "content": _prompt(args)}]
    from engine import check_messages

    check_messages(messages)  # before the model loads: an empty prompt is refused at once
    _print_model_sampling(args.model, taken)
    engine = _engine(args)
    seen: list = []
    events = _recorded(engine.stream(messages, sampling), seen)
    if args.json:
        for event in events:
            print(json.dumps(event.to_dict(), ensure_ascii=False), flush=True)
        finished = event
    else:
        finished = print_reply(events)
    if finished.reason == "error":
        print(f"phasescope: error: {finished.error}", file=sys.stderr)
        return 1
    if finished.speculation and not args.json:
        print(speculation_line(finished.speculation), file=sys.stderr)
    if engine.config.tensor_parallel > 1 and not args.json:
        print(tensor_parallel_line(seen), file=sys.stderr)
    engine.close()
    return 0


def _prompt(args: argparse.Namespace) -> str:
    """The prompt given as PROMPT or --prompt; "-" reads it from standard input (a file piped in)."""
    if args.text is not None and args.prompt is not None:
        raise ValueError("give the prompt once: as PROMPT or as --prompt, not both")
    prompt = args.prompt if args.prompt is not None else args.text
    if prompt is None:
        raise ValueError("no prompt: phasescope generate \"Your question\" (or --prompt TEXT, or - to read stdin)")
    return sys.stdin.read() if prompt == "-" else prompt


def _recorded(events, seen: list):
    for event in events:
        seen.append(event)
        yield event


def cmd_chat(args: argparse.Namespace) -> int:
    """The terminal chat, with the local engine or (--endpoint) a remote server measured from here; each
    conversation is saved in the history as the browser's chats are (`phasescope sessions`, `export`)."""
    from app.history.recorder import load_chat, make_recorder
    from app.history.store import Store
    from app.i18n import t
    from app.ui.session import ChatSession
    from app.ui.trace import ReplyTrace

    sampling, taken = _sampling(args)
    # first: a bad --db or --session fails before the model loads (and a chat to continue needs its database)
    store = Store.open(args.db, create=args.session is None)
    if args.session is not None and not store.has_session(args.session):
        raise ValueError(f"no session with id {args.session} in {store.path} (see `phasescope sessions`)")
    endpoint = _endpoint(args) if args.endpoint else None
    engine = None if endpoint else _engine(args)
    if endpoint:
        about, what = endpoint.info, f"{endpoint.model} at {endpoint.url} (client-side timings)"
    else:
        about = lambda: engine.info  # noqa: E731  (a session is about the model running when it starts)
        what = engine_line(engine)
    print(f"{what}; history: {store.path}. {CHAT_COMMANDS}.")
    _print_model_sampling(args.model, taken)
    record = make_recorder(store, about)
    session = ChatSession() if args.session is None else load_chat(store, args.session)
    for user, reply in zip(session.messages[::2], session.messages[1::2]):  # a continued chat so far
        print(f"\n>>> {user['content']}\n{reply['content']}")
    system = args.system
    if system is None and session.settings.get("system"):  # a continued chat goes on with its own
        system = session.settings["system"]
        print(_dim(f"system prompt (the session's): {system}"))

    def clear() -> None:
        nonlocal session, system
        session, system = ChatSession(), args.system

    def retry() -> str | None:
        """The last message, taken back with its reply to be sent again (the history marks that reply
        replaced); None before any reply."""
        return session.retract() if session.traces else None

    for text in _user_lines(clear, retry):
        messages = session.prompt(system, text)
        try:
            request = None if endpoint else engine.new_request(messages, sampling, fit=True)
        except ValueError as exc:  # empty, or a message longer than the context window: nothing is saved
            print(f"error: {exc}")
            continue
        if request is not None:
            session.sent_as(messages, request, engine.prompt_budget(sampling))
            messages = request.messages
        _print_warnings(session)
        trace = ReplyTrace(turn=len(session.traces) + 1)
        session.traces.append(trace)
        session.asked = text
        hooks = [trace.add]
        try:
            hooks.append(record(session, messages, sampling, trace))
        except Exception as exc:  # a full disk or a broken database must not stop the chat
            session.warn(t(session.lang, "warning.not_saved", detail=exc))
        if endpoint:
            stopped = threading.Event()
            events, stop = _through(endpoint.stream(messages, sampling, cancelled=stopped.is_set), hooks), stopped.set
        else:
            events, stop = engine.run(request, hooks), request.cancel
        try:
            with _ctrl_c_calls(stop):
                finished = print_reply(events)
        except KeyboardInterrupt:  # a second Ctrl-C, or one a tensor-parallel forward held until it ended
            events.close()  # cancels the request, or closes the remote connection
            print()
            finished = trace.finished
        _print_warnings(session)
        if trace.failed:
            print(f"error: {trace.finished.error}")
        else:
            session.converse(text, trace)
        if finished is not None and finished.metrics.num_generated_tokens:  # none: nothing was measured
            print(_dim(_remote_line(finished) if endpoint else _local_line(finished)))
    return 0


def _print_warnings(session) -> None:
    for warning in session.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    session.warnings.clear()


@contextmanager
def _ctrl_c_calls(stop: Callable[[], None]):
    """While a reply streams, Ctrl-C calls stop, as the page's Stop does: the reply ends with its text so
    far, saved as stopped, within a step (or a chunk, from a remote server). A second Ctrl-C interrupts."""
    def first(signum, frame) -> None:
        signal.signal(signal.SIGINT, previous)
        stop()

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _local_line(finished) -> str:
    """The engine's timing line after a reply, and what speculative decoding did."""
    note = "" if finished.reason in ("eos", "stop") else f" · ended: {finished.reason}"
    line = f"{summary_line(finished.metrics)}{note}"
    return f"{line}\n{speculation_line(finished.speculation)}" if finished.speculation else line


def _dim(text: str) -> str:
    """A timing line, dimmed on a terminal; plain where the output goes to a file or a pipe, or with NO_COLOR."""
    if sys.stdout.isatty() and not os.environ.get("NO_COLOR"):
        return f"\033[2m{text}\033[0m"
    return text


CHAT_COMMANDS = ("Type /retry for another reply to your last message, /edit TEXT to send TEXT in its place, "
                 "/clear for a new chat, /bye or Ctrl-D to leave, /? for help; Ctrl-C stops a reply")


def _line_editing() -> None:
    """At a terminal, the prompt edits its line (arrow keys, Ctrl-A, Ctrl-E...) and the up arrow brings back
    the lines typed before, as in `ollama run`: Python's input() does so once readline is imported. Kept in
    memory only: the conversations are in the history database, which only the user can read."""
    if sys.stdin.isatty():
        try:
            importlib.import_module("readline")  # importing it is all it takes
        except ImportError:  # not on every platform (Windows)
            pass


def _several_lines(line: str) -> str:
    """A message begun with three double quotes: its lines up to the one that ends with three more, as
    `ollama run` reads them, so that a pasted paragraph or a piece of code goes as one message, not a
    message a line. The lines stay as typed (code keeps its indentation)."""
    lines = []
    while not line.rstrip().endswith('"""'):
        lines.append(line)
        line = input("... ")
    lines.append(line.rstrip()[:-3])
    return "\n".join(lines).strip("\n")


def _user_lines(clear: Callable[[], None], retry: Callable[[], str | None]) -> Iterator[str]:
    """What the user types at the >>> prompt, line by line; /retry sends the last message again, /edit TEXT
    sends TEXT in its place (both take back the last exchange: retry), /clear starts a new chat, /bye or
    Ctrl-D ends (Ctrl-C drops the line being typed)."""
    _line_editing()
    while True:
        try:
            text = input("\n>>> ").strip()
            if text.startswith('"""'):
                text = _several_lines(text[3:])
        except EOFError:
            print()
            return
        except KeyboardInterrupt:  # the line is dropped and the chat goes on, as at a shell's prompt: a second
            print("\n(/bye or Ctrl-D leaves)")  # Ctrl-C meant for a reply that had just ended left the chat
            continue
        if text in ("/bye", "/exit", "/quit"):
            return
        if text == "/clear":
            clear()
            print("(new chat)")
        elif text == "/retry":
            again = retry()
            print(f"(again: {again})" if again else "(no reply to retry yet)")
            if again:
                yield again
        elif text == "/edit" or text.startswith("/edit "):
            edited = text[len("/edit"):].strip()
            if not edited:
                print("(/edit TEXT sends TEXT in place of your last message)")
            elif retry() is None:
                print("(no message to edit yet)")
            else:
                yield edited
        elif text in ("/?", "/help"):
            print(f"{CHAT_COMMANDS}. Any other line is sent to the model; a message of several lines (a pasted "
                  'paragraph, code) begins and ends with """, as in `ollama run`.')
        elif text.startswith("/") and " " not in text:  # a mistyped command, not a message (/usr/bin? is sent)
            print(f"(no command {text}: /? lists them)")
        elif text.strip():
            yield text


def _through(events, hooks):
    """Each event handed to the hooks, then passed on; closing this closes the source."""
    try:
        for event in events:
            for hook in hooks:
                hook(event)
            yield event
    finally:
        events.close()


def _remote_line(finished) -> str:
    """A remote reply's timing line: what was measured here (the server's cache is not visible), and
    the server's own timings where it sends them (llama.cpp's server does), and its gauges where its /metrics
    has them."""
    from app.remote.client import gauges_text, server_gauges, server_timings
    from app.ui.trace import held_seconds

    m = finished.metrics
    chunks = m.num_generated_tokens  # one per streamed chunk with text
    prompt = f"prompt {m.num_prompt_tokens} tok (cached {m.num_cached_tokens}) · " if m.num_prompt_tokens else ""
    line = (f"{prompt}TTFT {_num(m.ttft_ms, 0)} ms · TPOT {_num(m.tpot_ms, 2)} ms · "
            f"decode {_num(m.decode_tokens_per_s)} tok/s ({chunks} chunks) · E2E {_num(m.e2e_ms, 0)} ms (client-side)")
    server = finished.server or {}
    if timings := server_timings(server):
        line += (f" · server: prompt {timings.get('prompt_n', 0)} tok in {timings.get('prompt_ms', 0):,.1f} ms, "
                 f"decode {timings.get('predicted_per_second', 0):,.1f} tok/s, cached {timings.get('cache_n', 0)}")
    if held_s := held_seconds(finished.held_ms):  # a PhaseScope server's Lab held the request there
        line += f" · held there {held_s:,.1f} s by {', '.join(finished.held_ms)}"
    if gauges := server_gauges(server.get("metrics_before") or {}):  # as the request began: what it found there
        line += f" · server on arrival: {gauges_text(gauges)}"
    return line


def cmd_ui(args: argparse.Namespace) -> int:
    private_cache()  # before gradio is imported
    from app.main import launch
    from app.serve.access import check_exposure, check_port, parse_auth

    auth = parse_auth(args.auth)
    check_port(args.host, args.port)
    check_exposure(args.host, ui=True, api=False, auth=auth, api_key=None, insecure=args.insecure)
    launch(engine_config(args), host=args.host, port=args.port, db_path=args.db, open_browser=args.open, auth=auth)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ui:
        private_cache()  # before gradio is imported
    from app.serve import check_exposure, check_port, parse_auth, serve

    auth = parse_auth(args.auth)
    check_port(args.host, args.port)
    check_exposure(args.host, ui=args.ui, api=True, auth=auth, api_key=args.api_key, insecure=args.insecure)
    serve(engine_config(args), host=args.host, port=args.port, api_key=args.api_key, auth=auth, with_ui=args.ui,
          db_path=args.db)
    return 0


def cmd_sessions(args: argparse.Namespace) -> int:
    from app.history.store import Store, model_name

    store = Store.open(args.db, create=False, repair=False)
    rows = store.sessions(args.search)
    if not rows:
        print("no sessions" + (f" matching {args.search!r}" if args.search else ""))
        return 0
    # "run in": the precisions of the replies averaged (int8 and fp32 replies averaged together say so)
    print(f"{'id':>5}  {'updated':<19}  {'turns':>5}  {'TTFT ms':>8}  {'TPOT ms':>8}  {'run in':<9}  {'model':<24}  "
          "title")
    for row in rows:
        ttft = f"{row['mean_ttft_ms']:.0f}" if row["mean_ttft_ms"] is not None else "-"
        tpot = f"{row['mean_tpot_ms']:.1f}" if row["mean_tpot_ms"] is not None else "-"
        model = model_name(row["model"])
        print(f"{row['id']:>5}  {row['updated_at'][:19].replace('T', ' '):<19}  {row['turns']:>5}  {ttft:>8}  "
              f"{tpot:>8}  {row['precisions'] or '-':<9}  {model[:24]:<24}  {row['title']}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from app.history.export import write_export, write_to
    from app.history.store import Store

    store = Store.open(args.db, create=False, repair=False)
    if args.output:
        path = write_export(store, args.format, Path(args.output), args.session, force=args.force)
        print(f"wrote {path}", file=sys.stderr)
    else:
        write_to(sys.stdout, store, args.format, args.session)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from app.bench import tables as bench
    from app.bench.browser import browser_available
    from engine.config import PRECISIONS

    if args.from_json:
        print(bench.render(bench.load(Path(args.from_json)), args.output))
        return 0
    if args.endpoint:
        return _load_sweep(args)
    if args.quick:
        args.n_gen, args.repetitions, args.concurrency = 8, 1, "1,2"
    prompts = tuple(dict.fromkeys(_numbers(args.n_prompt or ("32" if args.quick else "512"), "-p", least=1)))
    if not prompts:
        raise ValueError("-p takes numbers separated by commas, got none")
    if min(args.n_gen, args.repetitions) < 1:
        raise ValueError("-n and -r must be at least 1")
    levels = _levels(args.concurrency)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or any(m not in PRECISIONS for m in modes):  # at once, before the model loads
        raise ValueError(f"--modes takes {', '.join(PRECISIONS)}, separated by commas, got {args.modes!r}")
    depths = _numbers(args.depth, "--depth", least=0)
    if args.llama_bench:  # at once, not after the twenty minutes that come before llama.cpp's turn
        _check_program(args.llama_bench, "--llama-bench")
    if args.browser and (why_not := browser_available()):
        print(f"phasescope bench: the browser will not be measured: {why_not}", file=sys.stderr)
    print(f"phasescope bench: {', '.join(f'pp{p}' for p in prompts)}, tg{args.n_gen}, {args.repetitions} repetitions, "
          f"modes {', '.join(modes)}", file=sys.stderr)
    report = bench.run(args.model, args.device, modes, prompts[0], args.n_gen, args.repetitions,
                       baseline=not args.no_baseline, llama_bench_path=args.llama_bench,
                       log=lambda line: print(line, file=sys.stderr, flush=True), concurrency_levels=levels,
                       depths=depths, tensor_parallel=args.tensor_parallel, quick=args.quick, more_pp=prompts[1:])
    if args.browser:
        report["summary"]["browser"] = _browser_bench(modes, args.quick)
    print(bench.render(report, args.output))
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    import json

    from app import lab
    from app.history.store import Store

    if args.experiment == "list":
        for experiment in lab.EXPERIMENTS.values():
            print(f"{experiment.name:<16} {experiment.title(args.lang)}")
        return 0
    names = list(lab.EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    unknown = [name for name in names if name not in lab.EXPERIMENTS]
    if unknown:
        raise ValueError(f"no experiment {unknown[0]!r}; choose one of: all, {', '.join(lab.EXPERIMENTS)}")
    store = Store.open(args.db, repair=False)  # first: a bad --db fails before the model loads (it writes lab runs)
    png = _png_folder(args.png)
    engine = _engine(args)
    engine.warm_up()
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    results = {}
    try:
        for name in names:
            if len(names) > 1 and (refusal := lab.cannot_run(engine, name, args.lang)):  # all: the rest runs
                log(f"lab {name}: left out: {refusal}")
                continue
            log(f"lab {name}{' (quick)' if args.quick else ''}:")
            result = lab.run(engine, name, args.prompt, args.quick,
                             progress=lambda text: log(f"  {lab.words(args.lang, text)}"))
            run_id = store.add_lab_run(name, {"prompt": result.prompt, "quick": result.quick, **result.settings},
                                       result.machine, result.to_dict())
            log(f"  {result.seconds:.1f} s; saved as lab run {run_id} in {store.path or 'memory'}")
            if png:
                log(f"  figure: {lab.write_image(lab.figure(result, args.lang), png / name)}")
            results[name] = result
    finally:
        engine.close()
    if args.output == "json":
        print(json.dumps({name: result.in_language(args.lang).to_dict() for name, result in results.items()},
                         indent=1, ensure_ascii=False))
    else:
        print("\n\n".join(result.markdown(args.lang) for result in results.values()))
    return 0


def _load_sweep(args: argparse.Namespace) -> int:
    import csv
    import io
    import json

    from app import lab
    from app.remote import sweep

    levels = _levels(args.concurrency)
    if min(args.requests, args.input_words, args.output_tokens) < 1 or (args.request_rate or 1) <= 0:
        raise ValueError("--requests, --input-words, --output-tokens and --request-rate must be positive")
    slo = sweep.parse_slo(args.slo)
    folder = _png_folder(args.png)  # before the sweep's minutes, not after
    endpoint = _endpoint(args)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    log(f"phasescope bench --endpoint {endpoint.url} ({endpoint.model}): concurrency {', '.join(map(str, levels))}")
    report = sweep.sweep(endpoint, levels, args.requests, args.input_words, args.output_tokens, args.random_lengths,
                         args.request_rate, slo, log, seed=args.seed)
    if folder:
        log(f"  chart: {lab.write_image(lab.figure(sweep.figure_result(report)), folder / 'load-sweep')}")
    if args.output == "json":
        print(json.dumps(report, indent=1))
    elif args.output == "csv":
        rows = sweep.csv_rows(report)
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        print(out.getvalue(), end="")
    else:
        print(sweep.markdown(report))
    return 0


def _png_folder(text: str | None):
    """--png's folder, made if missing; None without the option."""
    from pathlib import Path

    if not text:
        return None
    folder = Path(text).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--png takes a folder, and {folder} is a file")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _numbers(text: str, option: str, least: int | None = None) -> tuple[int, ...]:
    """Whole numbers separated by commas, in the order given, each at least `least` where given."""
    try:
        numbers = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise ValueError(f"{option} takes numbers separated by commas, got {text!r}") from None
    if least is not None and any(n < least for n in numbers):
        raise ValueError(f"{option} takes numbers >= {least}")
    return numbers


def _levels(text: str) -> tuple[int, ...]:
    """--concurrency's levels, in order, once each; 0 (and below): none."""
    return tuple(sorted({n for n in _numbers(text, "--concurrency") if n > 0}))


def _check_program(path: str, option: str) -> None:
    """That path names a program that can run: a file that is executable, or a name found on PATH as
    subprocess would find it."""
    import shutil

    if shutil.which(path):
        return
    if not os.path.isfile(path):
        raise ValueError(f"{option} {path}: no such file")
    if not os.access(path, os.X_OK):
        raise ValueError(f"{option} {path}: not executable (chmod +x it)")


def _browser_bench(modes: tuple[str, ...], quick: bool) -> dict:
    from app.bench.browser import browser_available, stream_vs_cli

    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    why_not = browser_available()
    if why_not:
        log(f"  browser: not measured: {why_not}")
        return {"skipped": why_not}
    rounds, tokens = (1, 16) if quick else (5, 128)  # five: the machine varies by 10 % from one reply to the next
    results = {mode: stream_vs_cli(mode, rounds, tokens, log) for mode in modes}
    log(f"  browser vs CLI: {results}")
    return results


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "bench": cmd_bench,
    "ui": cmd_ui,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "sessions": cmd_sessions,
    "export": cmd_export,
    "lab": cmd_lab,
    "serve": cmd_serve,
}


def _one_line(exc: BaseException) -> str:
    """An error as the user reads it: a file's error names the file and the reason, not "[Errno 2] …"."""
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        return f"{exc.filename}: {exc.strerror[0].lower()}{exc.strerror[1:]}"
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["ui", *argv]  # `phasescope` alone starts the app
    args = parser.parse_args(argv)
    if args.command in ("generate", "ui", "serve"):
        pause_collector()  # until the engine's modules are imported (see app/startup.py)
    from app.history.errors import StoreError
    from engine import ModelError

    engine_log = logging.getLogger("engine")  # what a first start does once (a conversion, int8 rows) that
    if not engine_log.handlers:  # takes a while
        said = logging.StreamHandler(sys.stderr)
        said.setFormatter(logging.Formatter("%(message)s"))
        engine_log.addHandler(said)
        engine_log.setLevel(logging.INFO)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # what read the output went away (`phasescope generate --json | head -1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor fail again flushing at exit
        return 128 + signal.SIGPIPE  # quietly, as a tool the signal ends: the shell's 141
    except (ModelError, StoreError, ValueError, OSError) as exc:
        print(f"phasescope: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
