"""The PhaseScope app: the browser UI (ui/), history (history/), the benchmark (bench/), the Optimization Lab
(lab/), the OpenAI-compatible server (serve/) and remote endpoints (remote/), over the engine's events."""
from .gradio_import import skip_stub_regeneration

skip_stub_regeneration()  # gradio's import rewrites its type stubs each time: half of it (see gradio_import)
