"""Who may reach the app: loopback only by default; any other address needs credentials (an API key for
the API, a user and password for the UI) or an explicit --insecure, which is said out loud. And whether
the address can be served at all, asked before the model loads."""
from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
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


def bare_host(value: str) -> str:
    """--host as given, an IPv6 address with or without its URL brackets ("[::1]" or "::1"), without them."""
    return value[1:-1] if value.startswith("[") and value.endswith("]") else value


def port_number(value: str) -> int:
    """--port: a TCP port, 1 to 65535 (argparse says what is wrong with any other value in one line)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a whole number, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 1 and 65535, got {port}")
    return port


def url_host(host: str) -> str:
    """host as a URL writes it: an IPv6 address in brackets (RFC 3986). Gradio builds its own URLs from
    the host it is given, so it takes it in this form."""
    return f"[{host}]" if ":" in host else host


def url_of(host: str, port: int) -> str:
    return f"http://{url_host(host)}:{port}"


def check_port(host: str, port: int) -> None:
    """OSError with one line when host:port cannot be served (another program listens there, the address
    is not this machine's), asked before the model loads: the server itself finds out only after it, and
    uvicorn's message then followed our line saying that the API runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                reason = "another program is listening there; choose another with --port"
            elif exc.errno == errno.EADDRNOTAVAIL:
                reason = "the address is not this machine's; choose another with --host"
            else:
                reason = (exc.strerror or str(exc)).lower()
            raise OSError(f"cannot serve on {host}:{port}: {reason}") from None
