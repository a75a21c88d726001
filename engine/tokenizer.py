"""A model's tokenizer straight from its folder with the `tokenizers` library, for the engine.

transformers' tokenizer classes wrap the same Rust tokenizer, but importing transformers takes ~0.6 s
of a cold start. This covers what the engine and the app use: encoding, decoding, token strings, the
special tokens and the chat template (rendered as transformers renders it: a sandboxed Jinja2
environment with trim_blocks, lstrip_blocks and loop controls). loader.load_tokenizer uses it for
plain tokenizers-backed folders only; tests check it against transformers' tokenizer.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cache
from pathlib import Path


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class FolderTokenizer:
    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        template_file = folder / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.exists() else config.get("chat_template")
        self.special_tokens = {name: _token_text(config.get(name)) for name in
                               ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_token_id = self._id(self.special_tokens["bos_token"])
        self.eos_token_id = self._id(self.special_tokens["eos_token"])
        self._template = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False):
        if self._template is None:
            self._template = _compile(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def _compile(source: str):
    """transformers' chat-template environment (tokenization_utils / chat_template_utils)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(source)


# --- a token's bytes ----------------------------------------------------------------------------------

@cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's bytes_to_unicode), reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for, also when they are only part of a character (its text alone is then
    U+FFFD): a byte-level piece read back, a SentencePiece byte (<0xE6>), or else its text in UTF-8."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    table = _byte_of_char()
    if piece and all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    if piece and (byte := _BYTE_PIECE.fullmatch(piece)):
        return bytes([int(byte.group(1), 16)])
    return tokenizer.decode([token_id]).encode("utf-8")
