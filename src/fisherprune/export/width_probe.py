"""A dry run of ``shrink`` on a masked model, which ``apply_masks`` runs with one channel of
each group removed, to keep whole any group the shrunk model could not follow.

A width is sometimes held in code the trace cannot follow: the hidden width read back from a
tensor's shape (``b, t, c = x.shape`` then ``reshape(b, t, 3, heads, c // heads)``), a per-head
bias table viewed to a shape tuple the module keeps (a MaxViT-style relative-position bias). Such
a group would make ``shrink`` (or the cost of the pruned model, which ``shrink`` computes for
its plan) fail or differ. Importing this module registers ``shrink_problem`` with
``fisherprune.graph.placement.register_group_trial`` (``graph`` cannot import ``export``).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from fisherprune._errors import first_line
from fisherprune.export.shrink import shrink_dry_run
from fisherprune.graph.placement import register_group_trial

__all__ = ["shrink_problem"]


def shrink_problem(model: nn.Module, example_inputs: Any) -> str | None:
    """Why ``shrink`` fails on the model as its masks now stand: the plan (with its cost)
    cannot be made, the shrunk copy does not run, or it does not give the masked model's
    outputs, or the model cannot be copied; None if it works. The model is left as it was
    (the dry run works on a copy sharing its tensors)."""
    try:
        with warnings.catch_warnings():  # a config that cannot follow one channel is no problem
            warnings.simplefilter("ignore")
            shrink_dry_run(model, example_inputs)
    except Exception as e:  # any failure is the reason these channels are not offered
        return (
            f"shrinking the model with one of these channels removed fails ({first_line(e)}): "
            "its code probably reads this width from a tensor's shape, or holds it as a size "
            "written into the code; the group is kept whole"
        )
    return None


register_group_trial(shrink_problem)
