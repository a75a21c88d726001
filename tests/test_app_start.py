"""The app serves its page before torch and the model load: the page is built from the engine's config
alone, and what shows the loaded model is drawn when a page loads."""
import subprocess
import sys

import pytest

from engine import EngineConfig, ModelError

BUILD_WITHOUT_TORCH = """
import sys
from app.main import LoadingEngine, build_app
from app.history.store import Store
from engine import EngineConfig
build_app(LoadingEngine(EngineConfig()), Store.open(sys.argv[1]))
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith(("engine.engine", "engine.llama")))
print(",".join(loaded) or "none")
"""


def test_the_page_is_built_without_importing_torch(tmp_path):
    out = subprocess.run([sys.executable, "-c", BUILD_WITHOUT_TORCH, str(tmp_path / "h.db")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none"


def test_the_loading_engine_waits_for_the_load_and_passes_on_its_error():
    from app.main import LoadingEngine

    engine = LoadingEngine(EngineConfig(model="/nonexistent/model", max_running=3))
    assert engine.config.max_running == 3  # known before the load: the page is built from it
    with pytest.raises(RuntimeError, match="before it started loading"):
        engine.info  # noqa: B018 - a read that would wait forever is refused
    engine.start()
    with pytest.raises(ModelError, match="not found"):
        engine.info  # noqa: B018
