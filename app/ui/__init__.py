"""The browser UI: one module per tab (chat_tab, history_tab), the panels and charts they draw, and the
per-user chat state (session) that feeds them from the engine's events."""
