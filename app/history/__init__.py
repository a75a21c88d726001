"""The history: a SQLite store of sessions, messages and every step (store), the engine hook that fills it
and the way back to a chat (recorder), and exports as CSV, JSON or a Chrome trace (export)."""
