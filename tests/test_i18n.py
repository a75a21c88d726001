"""The language catalogues: the same keys and fields in each, none missing from the code, none unused."""
from __future__ import annotations

import re
import string
from pathlib import Path

import pytest

from app.i18n import DEFAULT, LANGUAGES, catalogue, t
from app.ui import panels

APP = Path(__file__).resolve().parents[1] / "app"
QUOTED = re.compile(r"""["']([a-z_]+\.[a-z0-9_.]+)["']""")


def source() -> str:
    """The app's code, less the HTTP API's (its wire names, such as "chat.completion", are not UI words)."""
    return "\n".join(path.read_text(encoding="utf-8") for path in APP.rglob("*.py") if path.parent.name != "serve")


def fields(text: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(text) if name}


def test_every_language_has_the_same_keys_with_the_same_fields():
    english = catalogue(DEFAULT)
    for lang in LANGUAGES:
        other = catalogue(lang)
        assert set(english) - set(other) == set(), f"missing in {lang}"
        assert set(other) - set(english) == set(), f"only in {lang}"
        for key, text in english.items():
            assert fields(text) == fields(other[key]), (lang, key)
            assert other[key].strip(), (lang, key)


def test_every_key_the_code_names_exists_and_every_key_is_used():
    keys = set(catalogue(DEFAULT))
    sections = {key.split(".")[0] for key in keys}
    named = {key for key in QUOTED.findall(source()) if key.split(".")[0] in sections}
    assert named - keys == set(), "named in the code, missing from the catalogues"
    assert keys - named == set(), "in the catalogues, used nowhere"


def test_chinese_texts_are_chinese():
    chinese = catalogue("zh")
    han = re.compile(r"[\u4e00-\u9fff]")
    words = [key for key, text in chinese.items() if han.search(text)]
    assert len(words) > 0.8 * len(chinese)  # the rest are names and units (Top-p, TTFT (ms), lm_head…)


@pytest.mark.parametrize("lang", LANGUAGES)
def test_panels_render_in_each_language(lang):
    from test_charts import fake_reply

    trace = fake_reply(num_steps=4)
    for html in (panels.phase_html(trace, 2, lang, num_held=1), panels.kpi_html(trace, lang),
                 panels.queued_html(3, 2, lang),
                 panels.time_split_html(trace.metrics(), lang)):
        assert "{" not in html
    assert ("解码" in panels.phase_html(trace, lang=lang)) == (lang == "zh")


def test_an_unknown_language_falls_back_to_english():
    assert t("fr", "chat.send") == t(DEFAULT, "chat.send") == "Send"


def test_the_redraws_of_a_switch_run_as_one_event_each_with_its_own_inputs():
    """Texts' redraws go to the page in one request: each gets its inputs, a one-output redraw its value
    whole, and a component two redraws draw the later one's value unless that one skips."""
    import gradio as gr
    import pandas as pd

    from app.ui.language import together

    with gr.Blocks():
        a, b, c, shared, table = gr.HTML(), gr.HTML(), gr.HTML(), gr.HTML(), gr.Dataframe()
    frame = pd.DataFrame({"title": ["x"]})
    redraws = [(lambda lang, x: (f"{lang}:{x}", "first"), [a], [a, shared], False),
               (lambda lang: (1, 2), [], [b], False),  # one output: its value is the tuple
               (lambda lang, y, z: (gr.skip(), f"{y}{z}", frame), [b, c], [shared, c, table], False),
               (lambda lang: "later", [], [shared], False)]
    redraw, inputs, outputs = together(redraws[:3])
    assert [a, b, c] == inputs and [a, shared, b, c, table] == outputs
    drawn = redraw("zh", "A", "B", "C")
    assert ["zh:A", "first", (1, 2), "BC"] == drawn[:4] and drawn[4] is frame  # the skip left "first"
    redraw, _, outputs = together(redraws)
    assert "later" == redraw("en", "A", "B", "C")[outputs.index(shared)]


def test_a_redraw_that_fails_leaves_the_others_drawn(caplog):
    import gradio as gr

    from app.ui.language import together

    def broken(lang):
        raise RuntimeError("its database is gone")

    with gr.Blocks():
        a, b = gr.HTML(), gr.HTML()
    redraw, _, _ = together([(broken, [], [a], False), (lambda lang: f"{lang}!", [], [b], False)])
    assert [gr.skip(), "en!"] == redraw("en")
    assert "its database is gone" in caplog.text
