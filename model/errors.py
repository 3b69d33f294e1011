"""Every error class of the project, in one place; each message names what went wrong in the user's words.

Bad input raises a ``ValueError`` subclass (the CLIs exit with status 2 and one ``error:`` line, the app
shows a message in the page); a broken computation raises a ``RuntimeError`` subclass (exit status 1).
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A model source that cannot be loaded: unknown, missing files, unsupported option or device,
    an architecture the engine cannot decode correctly, or weights that do not fit in memory."""


class ContextBudgetError(ValueError):
    """The prompt, the answer and a forward pass's look-ahead do not fit in the model's positions."""


class NonFiniteLogitsError(RuntimeError):
    """A forward pass produced NaN or infinite logits: no token can be chosen from them."""


class DataError(ValueError):
    """Unusable training or evaluation data; the message names the file, the line (and column) and the
    reason."""


class NonFiniteLossError(RuntimeError):
    """A training step produced a non-finite loss or gradient; nothing was updated or written."""


class RequestError(ValueError):
    """A request the app refuses, with a message meant for the page."""


class Unsupported(Exception):
    """The fast forward path cannot run this model; the message says why (the library path runs
    instead). Not an error for the user: decoding goes on, only slower."""


class KernelError(ValueError):
    """A forced ``MTP_KERNELS`` path that cannot run here (an unknown value, instructions this CPU lacks, a failed
    build); the message is one line naming why."""
