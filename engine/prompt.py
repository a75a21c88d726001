"""From a conversation to prompt token ids: the checks a user's input must pass, and the chat template."""
from __future__ import annotations

ROLES = ("system", "user", "assistant")
WHICH = {"system": "the system prompt", "user": "a message", "assistant": "a reply"}  # for a message too long


class PromptTooLong(ValueError):
    """option: the setting that chose the limit (None: the model's context window)."""

    def __init__(self, num_tokens: int, limit: int, option: str | None = None) -> None:
        self.num_tokens, self.limit, self.option = num_tokens, limit, option
        super().__init__(f"the conversation is {num_tokens:,} tokens, but {self.which_limit}: start a new chat or "
                         "shorten the message")

    @property
    def which_limit(self) -> str:
        """The limit, in words: "the limit is N prompt tokens (option)" or the model's context window."""
        if self.option:
            return f"the limit is {self.limit:,} prompt tokens ({self.option})"
        return f"the model's context window is {self.limit:,} tokens"


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


def reply_message(text: str, token_ids: list[int]) -> dict:
    """A reply as the next turn's conversation holds it: its text, and the token ids the model generated
    for it (render_prompt prompts with these where they spell the text)."""
    return {"role": "assistant", "content": text, "token_ids": list(token_ids)}


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer has a chat template; a base model's has none (its messages are joined as text)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The whole conversation through the tokenizer's chat template, as token ids.

    A reply may carry the ids the model generated for it ("token_ids"): where they spell its text, they
    stand in the prompt in place of the text tokenized again, so that the next turn's prompt starts with
    exactly the tokens the KV cache holds and the prefix cache finds the whole conversation. Tokenized
    again, a reply can split differently (SmolLM2 writes "\n\n" as one token; its tokenizer, before a
    digit, as two), and the cache's match ends there."""
    texts = [{"role": m["role"], "content": valid_text(m["content"])} for m in messages]
    if not has_chat_template(tokenizer):
        return tokenizer("\n\n".join(m["content"] for m in texts))["input_ids"]
    text = tokenizer.apply_chat_template(texts, tokenize=False, add_generation_prompt=True)
    ids, done, end = [], 0, 0  # the ids so far, how much of text they cover, where the last message ends
    for message, plain in zip(messages, texts):
        at = text.find(plain["content"], end)
        if at < 0:  # a template that changes the text (e.g. trims it): no ids are taken from here on
            break
        end = at + len(plain["content"])
        generated = _spelling(tokenizer, message.get("token_ids"), plain["content"])
        if generated is not None:
            ids += tokenizer(text[done:at], add_special_tokens=False)["input_ids"] + generated
            done = end
    return ids + tokenizer(text[done:], add_special_tokens=False)["input_ids"]


def fit_conversation(tokenizer, messages: list[dict], ids: list[int], budget: int) -> tuple[list[dict], list[int]]:
    """A chat grown longer than the model can read, kept going as chat apps keep it: without its earliest
    exchanges. messages: a system prompt (if any), the exchanges so far, the new message; ids: their
    prompt; budget: the most prompt tokens wanted (the context window less room for the reply).

    Where the prompt fits the budget, nothing changes. Where it does not, the earliest exchanges after the
    system prompt are left out until the prompt takes at most half the budget, as llama.cpp's context
    shift discards half: the caller then sends the chat from the same message on, turn after turn, so
    that each next prompt starts as the last one did and the prefix cache finds it, instead of one more
    exchange falling out and the whole prompt being read again at every turn. The new message always
    stays: a message too long by itself is still refused."""
    if len(ids) <= budget:
        return messages, ids
    head = 1 if messages and messages[0]["role"] == "system" else 0
    cuts = [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]  # where the kept part may start
    if not cuts:  # one message: as it is
        return messages, ids

    def kept(cut: int) -> tuple[list[dict], list[int]]:
        part = messages[:head] + messages[cut:]
        return part, render_prompt(tokenizer, part)

    lo, hi = 0, len(cuts) - 1  # binary search: the fewest exchanges left out for at most half the budget
    found = None  # cuts[hi] rendered, once it is known to fit
    while lo < hi:
        mid = (lo + hi) // 2
        if len((part := kept(cuts[mid]))[1]) <= budget // 2:
            hi, found = mid, part
        else:
            lo = mid + 1
    return found or kept(cuts[lo])


def _spelling(tokenizer, token_ids, content: str) -> list[int] | None:
    """A reply's generated ids, without the end-of-turn token that closed it (the template writes its own),
    if they decode to exactly its text; else None."""
    if not content or not isinstance(token_ids, (list, tuple)):
        return None
    vocab = len(tokenizer)
    if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
        return None
    for ids in (list(token_ids), list(token_ids[:-1])):
        if tokenizer.decode(ids) == content:
            return ids
    return None
