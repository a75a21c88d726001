"""The errors a caller of the engine handles: each message is one line for the user."""


class ModelError(Exception):
    """A model that cannot be found or loaded; the message is one line for the user."""


def missing_weight(folder, name: str) -> ModelError:
    """A weights file without a tensor its architecture needs."""
    return ModelError(f"the weights in {folder} lack {name} (and perhaps more): a file cut short, or one of "
                      "another model")


class KVPoolTooSmall(ValueError):
    """A request that could never fit in the pool, however long it waited."""


class EngineBusy(RuntimeError):
    """A change that needs an idle engine (e.g. another precision) asked for while requests run; held:
    how many of them wait step by step for their user (explain mode's walk-through)."""

    def __init__(self, message: str, held: int = 0) -> None:
        super().__init__(message)
        self.held = held


class QueueFull(EngineBusy):
    """As many requests wait as the limits allow: try again shortly (HTTP 429)."""
