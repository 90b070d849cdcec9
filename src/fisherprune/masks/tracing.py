"""The one piece of global state masks share with the tracer: which tracer, if any, is running.

It lives here, below both layers, so that ``masks`` need not import ``graph``.
"""

from __future__ import annotations

import threading
from typing import Any

_state = threading.local()


def active() -> Any | None:
    """Return the tracer running on this thread, or None."""
    return getattr(_state, "tracer", None)


def set_active(tracer: Any | None) -> None:
    """Install (or clear, with None) the tracer of this thread."""
    _state.tracer = tracer
