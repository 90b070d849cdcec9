"""Short forms of exceptions for one-line messages."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(e: BaseException, with_type: bool = True) -> str:
    """The first non-empty line of ``e``'s message, prefixed by its type name unless
    ``with_type`` is False (``"RuntimeError: shapes do not match"``); the type name alone when
    the message is empty."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0].strip() if lines else ""
    if not with_type:
        return text or type(e).__name__
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
