"""The errors a caller of the engine handles: each message is one line for the user."""


class ModelError(Exception):
    """A model that cannot be found or loaded; the message is one line for the user."""


def missing_weight(folder, name: str) -> ModelError:
    """A weights file without a tensor its architecture needs."""
    return ModelError(f"the weights in {folder} lack {name} (and perhaps more): a file cut short, or one of "
                      "another model")


class NotEnoughMemory(ModelError):
    """Weights that would not fit in the memory left, said before they are made (the kernel would kill the
    process midway: a page, its replies and the other tabs gone without a word)."""

    def __init__(self, precision: str, needed: int, free: int, int8_needed: int) -> None:
        self.precision, self.needed_gb, self.free_gb = precision, needed / 1e9, free / 1e9
        self.int8_gb = int8_needed / 1e9 if precision != "int8" else None
        advice = (f"choose int8 (about {self.int8_gb:.1f} GB)" if self.int8_gb is not None
                  else "close other programs or choose a smaller model")
        super().__init__(f"the weights need about {self.needed_gb:.1f} GB in {precision} and {self.free_gb:.1f} GB "
                         f"of memory is free: {advice}")


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
