"""The project as a wheel (`pip install .` without -e, or a wheel built for another machine): every module and
file the app reads is in it, and the installed app finds its page's scripts there."""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tracked(*folders: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *folders], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.split()


def test_a_wheel_holds_every_file_of_the_app_and_the_installed_app_finds_them(tmp_path):
    source = tmp_path / "source"  # the tracked files alone: nothing built into the checkout
    for name in _tracked("pyproject.toml", "README.md", "app", "engine", "static"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("phasescope-*.whl"))
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    expected = {("app/" + name if name.startswith("static/") else name) for name in _tracked("app", "engine", "static")}
    assert sorted(expected - in_wheel) == []

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel: installing is unpacking it
    check = ("import app, app.cli, app.remote.client, app.ui.explain.views as views\n"
             f"assert app.__file__.startswith({str(site)!r}), app.__file__\n"
             "assert (app.STATIC / 'phasescope.js').is_file() and views.PIPELINE_SVG.is_file(), app.STATIC\n"
             "print(app.STATIC)")
    # -S: no .pth files, so not the checkout's editable install; the dependencies from this environment
    path = f"{site}:{sysconfig.get_paths()['purelib']}"
    out = subprocess.run([sys.executable, "-S", "-c", check], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(site / "app" / "static")
