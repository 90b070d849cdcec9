"""The one piece of global state masks share with the tracer: which tracer, if any, is running.

It lives here, below both layers, so that ``masks`` need not import ``graph``.
"""

from __future__ import annotations

import threading
from typing import Any


class _Active(threading.local):
    """This thread's tracer (a class default: no ``getattr`` fallback on each read, which
    every masked layer's forward makes)."""

    tracer: Any = None


_state = _Active()


def active() -> Any | None:
    """Return the tracer running on this thread, or None."""
    return _state.tracer


def set_active(tracer: Any | None) -> None:
    """Install (or clear, with None) the tracer of this thread."""
    _state.tracer = tracer
