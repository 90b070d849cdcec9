"""Each ``torch.compile`` call the library makes counts its own graphs, where torch can.

Dynamo keeps the graphs of one ``forward`` code object together, so every model of one class
compiled in a process (a run of ``PruningTrainer`` after another, each width the ``latency``
convention times in the ``compile`` form) adds to one count, and past
``torch._dynamo.config.recompile_limit`` (8) torch runs that ``forward`` eager, saying so only
in a log line. ``torch.compile(..., isolate_recompiles=True)`` (torch 2.13 has it) gives a
call a count of its own; ``ISOLATED`` holds that keyword where this torch has it, and is empty where
it does not (there the count stays shared: ``fisherprune.export.serving_forms`` lifts the
limit while it builds a form, and runs of the trainer share it, see ``train.compiling``).
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["ISOLATED"]

#: the keyword arguments that give a ``torch.compile`` call a recompile count of its own
ISOLATED: dict[str, bool] = (
    {"isolate_recompiles": True}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters
    else {}
)
