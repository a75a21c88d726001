"""`phasescope bench` and `phasescope lab`: the measurements, of this engine or of a remote server."""
from __future__ import annotations

import argparse
import os
import sys

from .options import endpoint_of, make_engine


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
    engine = make_engine(args)
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
    endpoint = endpoint_of(args)
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
