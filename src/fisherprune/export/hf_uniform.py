"""Under ``uniform=True``, keep a Hugging Face model describable by its config.

One config field can govern masks in several places (T5's ``d_ff`` is the MLP width of every
encoder and decoder block; ``num_heads`` that of self- and cross-attention), and some widths
have no field of their own (BERT, GPT-2 and ViT derive the head size from ``hidden_size /
num_attention_heads``, so their hidden width cannot shrink while the head size stays; a
pooler's width is ``hidden_size`` too). Importing this module registers a refiner with
``fisherprune.pruner.uniform``: for each class of copies it shrinks a copy of the model with one
channel removed from every copy and reads which config widths moved; classes that move the same
field are merged, and classes (merged or not) whose result the config cannot describe are left
whole, with the reason. It costs one trace, and one copy of the model per class, once, when a
``PruningOptimizer`` is made with ``uniform=True``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fisherprune._errors import first_line
from fisherprune.cost import CostModel
from fisherprune.export.hf_config import is_hf_model, read_widths, update_config
from fisherprune.export.plan import PruningPlan
from fisherprune.masks import MaskLayer
from fisherprune.masks.blocks import BlockGate
from fisherprune.masks.experts import ExpertGate
from fisherprune.masks.points import remembered_inputs
from fisherprune.pruner.prune import block_size, rounding
from fisherprune.pruner.uniform import register_uniform_refiner

__all__ = ["refine_for_config"]


def refine_for_config(
    model: nn.Module,
    example_inputs: Any,
    classes: list[list[str]],
    masks: Mapping[str, MaskLayer],
    round_to: int = 1,
) -> tuple[list[list[str]], dict[str, str]]:
    """``classes`` merged where they move the same config field, and the masks to leave
    whole (their result would not be describable by the config after a prune of one block of
    ``round_to`` channels from each), for a Hugging Face ``model``; other models get
    ``classes`` back unchanged. A ``BlockGate`` stays a class of its own, never left whole:
    removing blocks leaves the kept ones as they are, and ``shrink`` rewrites
    ``num_hidden_layers`` (``fisherprune.export.blocks``); so do the ``ExpertGate`` copies of
    the MoE layers (one class: each layer loses as many experts, and ``shrink`` rewrites
    ``num_experts``). The model is left as it was."""
    if not is_hf_model(model):
        return classes, {}
    gates = [c for c in classes if any(isinstance(masks[n], (BlockGate, ExpertGate)) for n in c)]
    classes = [c for c in classes if c not in gates]
    dense = read_widths(model)
    # one trace for every probe: a cost model reads its masks' values when asked
    traced = CostModel(model, remembered_inputs(model, example_inputs))
    whole: dict[str, str] = {}
    moved: list[set[str]] = []
    for members in classes:
        small = _probe(model, traced, members, masks, round_to)
        if isinstance(small, str):
            whole.update(dict.fromkeys(members, small))
            moved.append(set())
            continue
        widths = read_widths(small)
        moved.append({f for f in widths if widths[f] != dense.get(f)})
    merged = _merge(classes, moved, whole)
    for members in merged:
        small = _probe(model, traced, members, masks, round_to)
        reason = small if isinstance(small, str) else update_config(small)
        if reason:
            whole.update(dict.fromkeys(members, reason))
    return [c for c in merged if c[0] not in whole] + gates, whole


def _merge(
    classes: list[list[str]], moved: list[set[str]], whole: dict[str, str]
) -> list[list[str]]:
    """Union of the classes that move a common config field (same width required)."""
    parent = list(range(len(classes)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, fields in enumerate(moved):
        for f in fields:
            if f in owner:
                parent[root(i)] = root(owner[f])
            else:
                owner[f] = i
    out: dict[int, list[str]] = {}
    for i, members in enumerate(classes):
        if members[0] not in whole:
            out.setdefault(root(i), []).extend(members)
    return list(out.values())


def _probe(
    model: nn.Module,
    traced: CostModel,
    names: list[str],
    masks: Mapping[str, MaskLayer],
    round_to: int,
) -> nn.Module | str:
    """A shrunk copy of ``model`` (``traced``: a cost model of it) with one more block of
    channels (as ``prune`` removes with ``round_to``) removed from each mask in ``names``, or
    why it cannot be made. The model's masks are restored."""
    saved = {n: masks[n].mask.detach().clone() for n in names}
    all_ones = {n: masks[n].is_all_ones() for n in names}
    try:
        with torch.no_grad():
            for n in names:
                alive = torch.nonzero(saved[n] > 0.5).flatten()
                r = block_size(alive.numel(), rounding(masks[n], round_to))
                if alive.numel() <= r:
                    return "nothing is left to remove"
                masks[n].mask[alive[:r]] = 0.0
        plan = PruningPlan.from_model(model, cost_model=traced)
        small = copy.deepcopy(model)
        with warnings.catch_warnings():  # the config's verdict is read by the caller
            warnings.simplefilter("ignore")
            plan.apply(small)
        return small
    except Exception as e:  # a width the plan cannot remove is left whole
        return f"the model cannot be shrunk with these channels removed ({first_line(e)})"
    finally:
        with torch.no_grad():
            for n, m in saved.items():
                masks[n].mask.copy_(m)
                masks[n].record_values(all_ones[n])


register_uniform_refiner(refine_for_config)
