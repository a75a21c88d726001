"""`phasescope generate`: one prompt, its reply (or its events as JSON) and how it ran."""
from __future__ import annotations

import argparse
import json
import sys

from .lines import print_reply, speculation_line, tensor_parallel_line
from .options import make_engine, print_model_sampling, sampling_of


def _conversation(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def cmd_generate(args: argparse.Namespace) -> int:
    sampling, taken = sampling_of(args)
    messages = _conversation(args.system) + [{"role": "user", "content": _prompt(args)}]
    from engine import check_messages

    check_messages(messages)  # before the model loads: an empty prompt is refused at once
    print_model_sampling(args.model, taken)
    engine = make_engine(args)
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
