"""Measuring other engines: any OpenAI-compatible server, one chat at a time (client.py) or under load
(sweep.py), reported as PhaseScope's own events and metrics."""
from .client import Endpoint, KeyRefused

__all__ = ["Endpoint", "KeyRefused"]
