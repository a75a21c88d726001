"""The app's words in each language: one catalogue per language (en.json, zh.json), the same keys in
both (tests/test_i18n.py checks that none is missing or unused in either).

Code names a text by its key: t(lang, "phase.ready"), or K("chat.send") where a component is built (see
app/ui/language.py). A text may hold str.format fields, {tokens:,}, filled from t's keyword arguments.
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

LANGUAGES = {"en": "English", "zh": "简体中文"}
DEFAULT = "en"
FOLDER = Path(__file__).resolve().parent


class K(str):
    """A catalogue key standing where a component's text goes, so that the text follows the language."""


@cache
def catalogue(lang: str) -> dict[str, str]:
    return json.loads((FOLDER / f"{lang}.json").read_text(encoding="utf-8"))


def t(lang: str | None, key: str, **fields) -> str:
    """The text of key in lang (English for an unknown language), its fields filled in."""
    text = catalogue(lang if lang in LANGUAGES else DEFAULT)[key]
    return text.format(**fields) if fields else text
