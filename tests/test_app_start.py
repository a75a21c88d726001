"""The app serves its page before torch and the model load: the page is built from the engine's config
alone, and what shows the loaded model is drawn when a page loads."""
import os
import re
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
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith(("engine.engine", "engine.models.llama")))
print(",".join(loaded) or "none")
"""


def test_the_page_is_built_without_importing_torch(tmp_path):
    out = subprocess.run([sys.executable, "-c", BUILD_WITHOUT_TORCH, str(tmp_path / "h.db")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none"


SKIPS_STUBS = """
import app, gradio
from gradio import blocks_events, component_meta
for module in (component_meta, blocks_events):  # a later gradio without the step has nothing to skip
    print(getattr(getattr(module, "create_or_modify_pyi", None), "__name__", "_no_stubs"))
"""


def test_gradio_is_imported_without_rewriting_its_type_stubs():
    # half of `import gradio` (app/gradio_import.py); every other test builds pages with this gradio
    out = subprocess.run([sys.executable, "-c", SKIPS_STUBS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["_no_stubs", "_no_stubs"]


def test_gradios_queue_looks_for_events_every_20_ms_not_every_millisecond(tmp_path):
    # a thousand wake-ups a second took a core from decode (app.main._calm_queue); gradio's own default
    # would be 0.001 here: this checks the attribute is still where gradio reads it
    import gradio.queueing

    from app.history.store import Store
    from app.main import QUEUE_POLL_S, LoadingEngine, build_app

    page = build_app(LoadingEngine(EngineConfig()), Store.open(tmp_path / "h.db"))
    assert isinstance(page._queue, gradio.queueing.Queue)
    assert page._queue.sleep_when_free == QUEUE_POLL_S == 0.02
    assert gradio.queueing.Queue.start_processing.__code__.co_names.count("sleep_when_free") >= 1


def test_every_event_in_the_replies_concurrency_group_allows_the_batch(tmp_path):
    """Gradio gives a concurrency group the lowest limit of its events once each has run: one event of
    limit 1 among the replies' (a precision switch, an Explain demo) made every tab's chats reply in turn."""
    from app.history.store import Store
    from app.main import LoadingEngine, build_app

    config = EngineConfig()
    page = build_app(LoadingEngine(config), Store.open(tmp_path / "h.db"))
    limits = {fn.name: fn.concurrency_limit for fn in page.fns.values() if fn.concurrency_id == "engine"}
    assert limits and set(limits.values()) == {config.max_running}, limits


COLLECTOR_AT_START = """
import gc
from app import cli, startup

passes, at_settle = [], []
gc.callbacks.append(lambda phase, info: phase == "start" and passes.append(info["generation"]))
settle = startup.settle
paused = startup.pause_collector
startup.pause_collector = lambda: (passes.clear(), paused())
startup.settle = lambda: (at_settle.append(len(passes)), settle())
code = cli.main(["generate", "--prompt", "Hi", "--max-new-tokens", "1"])
print(code, at_settle, gc.isenabled(), gc.get_freeze_count() > 100_000)
"""


@pytest.mark.model
def test_the_collector_sleeps_through_the_imports_and_then_skips_them():
    # app/startup.py: from the command's start to the end of torch's import no pass of the collector
    # (390 before, 0.19 s of a cold start), on again after it, with what the imports made frozen out
    out = subprocess.run([sys.executable, "-c", COLLECTOR_AT_START], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "0 [0] True True"


def test_settle_leaves_a_collector_it_did_not_pause_alone():
    import gc

    from app.startup import settle

    frozen = gc.get_freeze_count()
    settle()  # as in the tests and a notebook: the collector was on
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_the_loading_engine_waits_for_the_load_and_passes_on_its_error():
    from app.main import LoadingEngine

    engine = LoadingEngine(EngineConfig(model="/nonexistent/model", max_running=3))
    assert engine.config.max_running == 3  # known before the load: the page is built from it
    engine.start()
    with pytest.raises(ModelError, match="not found"):
        engine.info  # noqa: B018


def test_a_first_start_says_what_it_does_once(tmp_path, tiny, monkeypatch):
    """The stages of a load, as the page's status line names them while it waits (a first start of the
    bundled model converts its GGUF for ten seconds): a folder's int8 rows made once among them (a fresh
    cache; without the native step, whose compile, said the same way, takes 8 s)."""
    from app.main import LoadStages, start_engine

    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    monkeypatch.setenv("PHASESCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PHASESCOPE_FUSED_DECODE", "0")
    seen = []

    def record(name, **params):
        seen.append(name)

    with LoadStages(record):
        start_engine(EngineConfig(model=str(tmp_path / "m"), precision="int8"), on_stage=record).stop()
    assert seen == ["import", "read", "quantize", "warm"]


@pytest.mark.browser
@pytest.mark.model
def test_a_message_sent_while_the_model_loads_waits_for_it(tmp_path):
    """In the browser: the page comes up saying the model is loading; a message sent then waits, and is
    answered once the model serves; the model line and the precision list are drawn when it does. The
    language switched meanwhile: the lines say so in it, and still count the seconds (the tabs' redraws,
    which read the model, had each held one of the browser's six connections to the app until the load
    ended, and with a reply's stream no request was left for the timers)."""
    from pathlib import Path

    from app.bench.browser import CHROMIUM, free_port, launch_browser, open_chat, send, set_setting, wait_phase
    from app.history.store import Store
    from app.main import LoadingEngine, build_app, launch_options

    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed")
    from playwright.sync_api import sync_playwright

    engine, store = LoadingEngine(EngineConfig(precision="int8")), Store.open(str(tmp_path / "h.db"))
    saved = store.create_session("Colours", "SmolLM2-135M-Instruct", "cpu", "int8", {})
    store.update_message(store.add_reply(saved, 1, "Name a colour."), content="Teal.", status="complete",
                         finish_reason="stop")
    app = build_app(engine, store)
    port = free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_options())
    try:
        with sync_playwright() as playwright:
            browser = launch_browser(playwright)
            # a tab reloaded while the model loads: its chat shows, and the panel once the model has loaded
            reloaded = browser.new_page()
            reloaded.add_init_script(f"sessionStorage.setItem('phasescope-chat', '{store.session_key(saved)}')")
            reloaded.goto(f"http://127.0.0.1:{port}")
            reloaded.wait_for_selector("#ps-chatbot [data-testid=bot]:has-text('Teal.')")
            assert "Loading the model" in reloaded.inner_text("#ps-model-line")
            page = open_chat(browser, f"http://127.0.0.1:{port}", model_drawn=False)
            assert "Loading the model" in page.inner_text("#ps-model-line")
            assert "Loading the model — starting · " in page.inner_text("#ps-phase")  # not "Ready"
            for tab in ("Explain", "Lab", "Chat"):  # a Start or a Run clicked there waits for the model too
                page.get_by_role("tab", name=tab).click()
                if tab != "Chat":
                    assert "Loading the model — starting · " in page.inner_text(f"#ps-{tab.lower()}-loading")
                if tab == "Explain":  # each key a request for the prompt's tokens, and Pause: none waits for the model
                    page.locator("#ps-explain-prompt textarea").press_sequentially(" and why?", delay=50)
                    page.locator("#ps-explain-pause").click()
                    counted = page.inner_text("#ps-explain-loading")
                    page.wait_for_function("(before) => document.querySelector('#ps-explain-loading').innerText"
                                           " !== before", arg=counted)
                    # no request waits for the model: Gradio would count its seconds over the panels
                    assert not re.search(r"\d\.\ds", page.inner_text("#ps-explain-steps"))
            page.get_by_text("简体中文", exact=True).click()
            page.wait_for_function("() => document.querySelector('#ps-model-line').innerText === "
                                   "'正在加载模型…'")
            set_setting(page, "ps-max-new", 8)
            send(page, "Hi")
            page.wait_for_function("() => document.querySelector('#ps-phase').innerText.endsWith("
                                   "'模型加载好后即回复你的消息')")
            counted = page.inner_text("#ps-phase")
            page.wait_for_function("(before) => document.querySelector('#ps-phase').innerText !== before", arg=counted)
            assert not page.query_selector("#ps-phase [data-phase=done]")  # waiting for the model
            engine.start()  # as launch() does, once the page is up
            wait_phase(page, "done")
            assert page.locator("#ps-chatbot .message").count() >= 2
            page.wait_for_function("() => document.querySelector('#ps-model-line').innerText.includes('权重 int8')")
            assert "int8" in page.input_value("#ps-precision input")
            wait_phase(reloaded, "done")
            assert "Name a colour." in reloaded.inner_text("#ps-chatbot")
            page.get_by_role("tab", name="讲解").click()
            page.wait_for_selector("#ps-explain-loading", state="hidden")
            page.wait_for_selector("#ps-explain-tokens [data-tokens]")  # the prompt's tokens: drawn once it has loaded
            browser.close()
    finally:
        app.close()
        if not engine.loading:  # stop waits for a load: one the test did not start (failing before) never ends
            engine.stop()


LOOKUPS = """
import os, socket
_getaddrinfo = socket.getaddrinfo
def getaddrinfo(host, *args, **kwargs):  # every host the process looks up, before it connects
    with open(os.environ["PHASESCOPE_TEST_LOOKUPS"], "a", encoding="utf-8") as f:
        print(host, file=f)
    return _getaddrinfo(host, *args, **kwargs)
socket.getaddrinfo = getaddrinfo
"""


@pytest.mark.model
def test_the_app_calls_no_host_but_its_own(tmp_path, monkeypatch):
    """Gradio, unless a page turns it off, sends telemetry about the page (api.gradio.app, huggingface.co)
    and asks for its latest version when the app starts: a local chat app calls nobody."""
    import time
    import urllib.request

    from app.bench.browser import start_app

    (tmp_path / "sitecustomize.py").write_text(LOOKUPS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PHASESCOPE_TEST_LOOKUPS", str(tmp_path / "lookups.txt"))
    process, url = start_app("--db", str(tmp_path / "h.db"))
    try:
        assert urllib.request.urlopen(url, timeout=30).status == 200
        time.sleep(2)  # the telemetry's threads start with the page and with its launch
    finally:
        process.terminate()  # its temporary folders go with it
        process.wait(30)
    hosts = set((tmp_path / "lookups.txt").read_text().split())
    assert "127.0.0.1" in hosts and hosts <= {"127.0.0.1", "localhost", "::1"}, hosts


@pytest.mark.model
@pytest.mark.parametrize("command", [["ui"], ["serve", "--ui"]])
def test_sigterm_ends_the_app_as_ctrl_c_does_and_its_temporary_folders_go(tmp_path, command):
    """kill, systemd and docker stop send SIGTERM, whose default ended the app at once and left gradio's
    cache and the exports' folder (conversations) in /tmp, one pair per start."""
    import glob
    import signal
    import time
    import urllib.request

    from app.bench.browser import free_port

    temporary = tmp_path / "tmp"  # the app's own /tmp (TMPDIR): another run's folders are not counted
    temporary.mkdir()

    def folders() -> set[str]:
        return {*glob.glob(f"{temporary}/phasescope-gradio-*"), *glob.glob(f"{temporary}/phasescope-exports-*")}

    before = folders()
    env = {**os.environ, "TMPDIR": str(temporary)}
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "app.cli", *command, "--port", str(port), "--db",
                                str(tmp_path / "h.db")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env)
    try:
        for line in process.stdout:
            if "decode:" in line and command == ["ui"] or "API at" in line:  # the page built
                break
        for _ in range(600):  # serving: uvicorn starts after serve's line
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/{'ui/' if 'serve' in command else ''}", timeout=60)
                break
            except OSError:
                time.sleep(0.1)
        assert len(folders() - before) == 2
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0 and folders() - before == set()
    # and while the model loads, the page already served (ui) or not yet built (serve): as a Ctrl-C then
    process = subprocess.Popen([sys.executable, "-m", "app.cli", *command, "--port", str(port), "--db",
                                str(tmp_path / "h.db")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env)
    try:
        for line in process.stdout:
            if "Loading the model" in line:
                break
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and folders() - before == set()


def test_the_command_says_its_version():
    out = subprocess.run([sys.executable, "-m", "app.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and re.fullmatch(r"phasescope \d+\.\d+\.\d+\S*\n", out.stdout), out
