"""The Explain tab: one generation stepped through token by token (tab.py), what each step shows
(views.py), and one-click demonstrations of how TTFT, TPOT and the KV cache behave (demos.py)."""
from .tab import build

__all__ = ["build"]
