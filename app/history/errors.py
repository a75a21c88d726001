"""The history's error, apart from the store: the CLI catches it without importing sqlite_utils (which
imports pandas when it is installed: 0.4 s of `phasescope generate`'s start)."""


class StoreError(Exception):
    """A history database that cannot be used; the message is one line for the user."""


class SessionMoved(StoreError):
    """A chat sent a reply to a session that has moved on without it: another tab (or a terminal chat)
    continued the same session meanwhile."""


class SessionReplying(StoreError):
    """A session that cannot be deleted now: one of its replies is being written."""
