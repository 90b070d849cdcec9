"""first_line: the one-line form of an exception used in CLI and shrink messages."""

from __future__ import annotations

import pytest

from fisherprune._errors import first_line


@pytest.mark.parametrize(
    ("error", "with_type", "expected"),
    [
        (RuntimeError("shapes differ\n  at layer 3"), True, "RuntimeError: shapes differ"),
        (RuntimeError("\n\n  shapes differ  \nmore"), True, "RuntimeError: shapes differ"),
        (RuntimeError(), True, "RuntimeError"),  # an empty message must not raise IndexError
        (RuntimeError(), False, "RuntimeError"),
        (ValueError("bad size\ndetails"), False, "bad size"),
    ],
)
def test_first_line_is_the_first_non_empty_line_with_its_type(
    error: BaseException, with_type: bool, expected: str
) -> None:
    """The first non-empty line of the message, stripped, with the type name in front (or
    the type name alone for an empty message)."""
    assert first_line(error, with_type) == expected
