"""`import gradio` without rewriting gradio's type stubs, and with a cache of its own.

Every `import gradio` regenerates the `.pyi` stub of each component class it defines: gradio's
`component_meta.create_or_modify_pyi` reads the class's source and parses it with `ast`, 81 times. On the
2-core machine that is 1.6 s of a 3.2 s import, before the app can serve its page, for files the gradio
wheel already ships and only an editor reads. So `app` (its __init__) installs the finder below: once
gradio's `component_meta` module has run, and before any component class is defined, its
`create_or_modify_pyi` becomes a no-op. Nothing else in gradio changes.

The files gradio serves (the History tab's exports: whole conversations) it copies into its cache, by
default `/tmp/gradio`, made with the umask's mode: other users of the machine could read them there for a
day, and a cache another user made first refused them. `private_cache` gives the app's process its own.
"""
from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import tempfile
from pathlib import Path

MODULE = "gradio.component_meta"


def _no_stubs(*_args, **_kwargs) -> None:
    """Stands in for gradio's create_or_modify_pyi: the stubs shipped in the wheel stay as they are."""


class _SkipStubs(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            if hasattr(module, "create_or_modify_pyi"):
                module.create_or_modify_pyi = _no_stubs

        spec.loader.exec_module = exec_module
        return spec


def skip_stub_regeneration() -> None:
    """Install the finder, unless gradio is imported already (then its import has paid the cost)."""
    if MODULE not in sys.modules and not any(isinstance(f, _SkipStubs) for f in sys.meta_path):
        sys.meta_path.insert(0, _SkipStubs())


def private_folder(prefix: str) -> Path:
    """A new folder only this user can read (mkdtemp's 0700), removed when the process exits: for the files
    gradio serves (its cache, the History tab's and the Lab's downloads)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(folder)


def private_cache() -> None:
    """Before gradio is imported (some of its modules read the setting then): its cache in a private_folder;
    unless GRADIO_TEMP_DIR names one."""
    if not os.environ.get("GRADIO_TEMP_DIR"):
        os.environ["GRADIO_TEMP_DIR"] = str(private_folder("phasescope-gradio-"))
