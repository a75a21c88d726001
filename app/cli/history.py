"""`phasescope sessions` and `phasescope export`: the history database from the terminal."""
from __future__ import annotations

import argparse
import sys


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
