"""From a conversation to prompt token ids: the checks a user's input must pass, and the chat template."""
from __future__ import annotations

ROLES = ("system", "user", "assistant")
WHICH = {"system": "the system prompt", "user": "a message", "assistant": "a reply"}  # for a message too long


class PromptTooLong(ValueError):
    """option: the setting that chose the limit (None: the model's context window)."""

    def __init__(self, num_tokens: int, limit: int, option: str | None = None) -> None:
        where = f"the limit is {limit:,} prompt tokens ({option})" if option else \
            f"the model's context window is {limit:,} tokens"
        super().__init__(f"the conversation is {num_tokens:,} tokens, but {where}: start a new chat or shorten "
                         "the message")
        self.num_tokens, self.limit, self.option = num_tokens, limit, option


def check_messages(messages: list[dict], max_chars: int | None = None) -> None:
    if not messages:
        raise ValueError("the conversation is empty")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"each message needs a role ({', '.join(ROLES)}) and text content")
        if max_chars is not None and len(message["content"]) > max_chars:
            raise ValueError(f"{WHICH[message['role']]} holds {len(message['content']):,} characters; the limit is "
                             f"{max_chars:,} (--limit-message-chars)")
    if messages[-1]["role"] != "user":
        raise ValueError(f"the last message must be the user's, not the {messages[-1]['role']}'s")
    if not messages[-1]["content"].strip():
        raise ValueError("the message is empty")


def valid_text(text: str) -> str:
    """Text a tokenizer can encode: a lone surrogate (valid JSON, invalid Unicode) becomes U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The whole conversation through the tokenizer's chat template, as token ids."""
    messages = [{**m, "content": valid_text(m["content"])} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
