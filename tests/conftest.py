"""Shared test settings: with pytest-xdist, each worker's torch uses its share of the cores
(two workers each running torch's default of every core would fight over them)."""

from __future__ import annotations

import os

import torch

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
