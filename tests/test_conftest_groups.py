"""``conftest.BUILT_ONCE`` names fixtures that exist: a renamed fixture would silently stop
keeping its tests on one worker."""

from __future__ import annotations

import importlib

import pytest

from tests.conftest import BUILT_ONCE


@pytest.mark.parametrize("module", sorted(BUILT_ONCE))
def test_every_fixture_built_once_is_a_fixture_of_its_module(module: str) -> None:
    mod = importlib.import_module(f"tests.{module}")
    for name in BUILT_ONCE[module]:
        assert repr(getattr(mod, name, None)).startswith("<pytest_fixture("), (
            f"tests/{module}.py has no fixture {name!r}: update tests/conftest.py BUILT_ONCE"
        )
