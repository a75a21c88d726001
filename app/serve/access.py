"""Who may reach the app: loopback only by default; any other address needs credentials (an API key for
the API, a user and password for the UI) or an explicit --insecure, which is said out loud."""
from __future__ import annotations

import ipaddress
import os
import sys

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def parse_auth(value: str | None) -> tuple[str, str] | None:
    """"user:password" (from --auth or PHASESCOPE_AUTH) as Gradio's auth pair."""
    value = value if value is not None else os.environ.get("PHASESCOPE_AUTH")
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ValueError("--auth takes user:password (both non-empty)")
    return user, password


def check_exposure(host: str, *, ui: bool, api: bool, auth: tuple[str, str] | None, api_key: str | None,
                   insecure: bool) -> None:
    """Refuse (ValueError, one line) to serve a non-loopback address without credentials for what is served,
    unless --insecure; then warn."""
    if is_loopback(host):
        return
    missing = []
    if api and not api_key:
        missing.append("--api-key KEY")
    if ui and not auth:
        missing.append("--auth user:password (or PHASESCOPE_AUTH)")
    if not missing:
        return
    if not insecure:
        raise ValueError(f"binding to {host} lets anyone on the network in: give {' and '.join(missing)}, "
                         "or --insecure to serve it without")
    print(f"WARNING: serving on {host} without {' or '.join(missing)}: anyone who can reach this machine can use "
          "it (--insecure)", file=sys.stderr, flush=True)
