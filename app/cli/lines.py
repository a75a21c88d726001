"""What the terminal prints about a run: how the engine runs, and a reply's timing lines."""
from __future__ import annotations

import os
import sys


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


def local_line(finished) -> str:
    """The engine's timing line after a reply, and what speculative decoding did."""
    note = "" if finished.reason in ("eos", "stop") else f" · ended: {finished.reason}"
    line = f"{summary_line(finished.metrics)}{note}"
    return f"{line}\n{speculation_line(finished.speculation)}" if finished.speculation else line


def dim(text: str) -> str:
    """A timing line, dimmed on a terminal; plain where the output goes to a file or a pipe, or with NO_COLOR."""
    if sys.stdout.isatty() and not os.environ.get("NO_COLOR"):
        return f"\033[2m{text}\033[0m"
    return text


def remote_line(finished) -> str:
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
