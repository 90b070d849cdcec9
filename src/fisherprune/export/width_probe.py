"""A dry run of ``shrink`` on a masked model, which ``apply_masks`` runs with one channel of
each group removed, to keep whole any group the shrunk model could not follow.

A width is sometimes held in code the trace cannot follow: the hidden width read back from a
tensor's shape (``b, t, c = x.shape`` then ``reshape(b, t, 3, heads, c // heads)``), a per-head
bias table viewed to a shape tuple the module keeps (a MaxViT-style relative-position bias). Such
a group would make ``shrink`` (or the cost of the pruned model, which ``shrink`` computes for
its plan) fail or differ. Importing this module registers ``shrink_trial`` with
``fisherprune.graph.placement.register_group_trial`` (``graph`` cannot import ``export``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from fisherprune._errors import first_line
from fisherprune.cost import CostModel
from fisherprune.export.shrink import ShrinkError, shrink_dry_run
from fisherprune.graph.placement import TrialProblem, register_group_trial
from fisherprune.graph.trace import Trace

__all__ = ["shrink_trial"]


def shrink_trial(
    model: nn.Module, example_inputs: Any, trace: Trace
) -> Callable[[], TrialProblem | None]:
    """The trial ``apply_masks`` runs for each set of mask values it tries: why ``shrink``
    fails on the model as its masks then stand (the plan, with its cost, cannot be made; the
    shrunk copy does not run, or does not give the masked model's outputs; the model cannot be
    copied), or None if it works. Every trial reads its plan off one cost model built on
    ``trace``, the masked model's (its masks' places are fixed; only their values change).
    Each trial leaves the model as it was (the dry run works on a copy sharing its tensors)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cost_model = CostModel(model, example_inputs, trace=trace)
    except Exception as e:  # its cost cannot be made whatever is removed
        failed = _problem(e)
        return lambda: failed

    def trial() -> TrialProblem | None:
        try:
            with warnings.catch_warnings():  # a config that cannot follow one channel is fine
                warnings.simplefilter("ignore")
                shrink_dry_run(model, example_inputs, cost_model=cost_model)
        except Exception as e:  # any failure is the reason these channels are not offered
            return _problem(e)
        return None

    return trial


def _problem(e: Exception) -> TrialProblem:
    return TrialProblem(
        f"shrinking the model with one of these channels removed fails ({first_line(e)}): "
        "its code probably reads this width from a tensor's shape, or holds it as a size "
        "written into the code; the group is kept whole",
        e.module if isinstance(e, ShrinkError) else None,
    )


register_group_trial(shrink_trial)
