"""The PhaseScope app: the browser UI (ui/), history (history/), the benchmark (bench/), the Optimization Lab
(lab/), the OpenAI-compatible server (serve/) and remote endpoints (remote/), over the engine's events."""
from pathlib import Path

from .gradio_import import skip_stub_regeneration

_HERE = Path(__file__).resolve().parent
# the page's scripts, styles and drawings: static/ beside app/ in the repository, app/static in a wheel
STATIC = _HERE / "static" if (_HERE / "static").is_dir() else _HERE.parent / "static"

skip_stub_regeneration()  # gradio's import rewrites its type stubs each time: half of it (see gradio_import)
