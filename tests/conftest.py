"""Shared test settings: with pytest-xdist, each worker's torch uses its share of the cores
(two workers each running torch's default of every core would fight over them); transformers'
cache of remote modelling code and inductor's compile cache lie under the session's temporary
folder."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator

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


@pytest.fixture(autouse=True, scope="session")
def _inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """AOTInductor exports (and the processes a test starts) compile into the session's
    temporary folder, not ``/tmp/torchinductor_$USER``: tests write only under their temporary
    folders, and no run leans on a cache an earlier run left. A cache the caller names in
    ``TORCHINDUCTOR_CACHE_DIR`` is kept."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "inductor")
    yield
    del os.environ["TORCHINDUCTOR_CACHE_DIR"]


#: module-scoped fixtures that take seconds to build (a torchrun launch, a killed and resumed
#: run, an AOTInductor compile, a trained network), by test module. With pytest-xdist's
#: ``--dist loadgroup`` (in pyproject's addopts) every test using one runs on the same
#: worker, so that it is built once rather than once per worker that draws one of its tests.
BUILT_ONCE = {
    "test_cli": ("trained", "checkpointed", "resumed"),
    "test_distributed": ("torchrun",),
    "test_export": ("onnx_files", "aoti_package", "aoti_two_inputs"),
    "test_fsdp_recover": ("runs",),
    "test_half_precision": ("bank",),
    "test_inputs": ("aoti_tagger",),
    "test_no_collapse": ("trained",),
    "test_no_host_sync": ("ddp_records",),
    "test_train_export_set": ("finished",),
    "test_train_shrunk": ("runs",),
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put each test that uses a ``BUILT_ONCE`` fixture in that fixture's xdist group."""
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        for name in BUILT_ONCE.get(module, ()):
            if name in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(f"{module}.{name}"))
