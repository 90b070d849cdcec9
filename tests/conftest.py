"""Shared test settings: with pytest-xdist, each worker's torch uses its share of the cores
(two workers each running torch's default of every core would fight over them); transformers'
cache of remote modelling code lies under the session's temporary folder."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(autouse=True)
def _hf_modules_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Loading a folder with ``trust_remote_code=True`` (the ``hf/`` of an uneven prune)
    copies its modelling code into transformers' module cache: point it (and the processes a
    test starts) at the session's temporary folder, not ``~/.cache``. Imports nothing new."""
    cache = str(tmp_path_factory.getbasetemp() / "hf_modules")
    monkeypatch.setenv("HF_MODULES_CACHE", cache)
    if "transformers" in sys.modules:
        modules = importlib.import_module("transformers.dynamic_module_utils")
        monkeypatch.setattr(modules, "HF_MODULES_CACHE", cache)
