"""The token ids of the server's recent chat replies. A client sends a conversation back as text, and a
reply tokenized again can split otherwise than the model wrote it (SmolLM2's one "\n\n" token becomes
two before a digit), which ends the prefix cache's match there. Where a message of the conversation is one
of these replies, word for word, it goes to the engine with the ids it was generated as, as the chat page
sends its own (engine.render_prompt), and the next turn finds the whole conversation in the cache."""
from __future__ import annotations

import threading
from collections import OrderedDict

from engine import reply_message

REMEMBERED = 256  # replies, the least recently sent or used forgotten first


class RecentReplies:
    def __init__(self, limit: int = REMEMBERED) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()  # cheap, and safe whichever thread an answer finishes on

    def remember(self, text: str, token_ids: list[int]) -> None:
        if not text or not token_ids:
            return
        with self._lock:
            self._ids[text] = tuple(token_ids)
            self._ids.move_to_end(text)
            while len(self._ids) > self.limit:
                self._ids.popitem(last=False)

    def attach(self, messages: list[dict]) -> list[dict]:
        """The conversation, its assistant messages that are remembered replies with their token ids."""
        out = []
        with self._lock:
            for message in messages:
                ids = self._ids.get(message["content"]) if message["role"] == "assistant" else None
                if ids is not None:
                    self._ids.move_to_end(message["content"])
                    message = reply_message(message["content"], ids)
                out.append(message)
        return out
