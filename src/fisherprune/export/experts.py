"""Removing gated-off experts: the expert half of a ``PruningPlan``.

The tensors of an expert gate (the router's weight, the experts' stacked parameters) lose the
removed experts' slices along dim 0 through the plan's slicing, as every channel does
(``CostModel.removed`` counts an expert's components as removed). What slicing does not
change are the integer counts the modules keep and their forward reads (the router's and the
experts' ``num_experts``, Mixtral's ``num_local_experts``): this module gives the plan those.
A Hugging Face ``config`` follows through ``fisherprune.export.hf_config`` when every layer
keeps the same number of experts.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from fisherprune.masks import MaskLayer
from fisherprune.masks.experts import COUNT_ATTRIBUTES, ExpertGate

__all__ = ["expert_count_attributes"]


def expert_count_attributes(
    model: nn.Module, masks: Mapping[str, MaskLayer]
) -> dict[str, dict[str, int]]:
    """``{module name: {attribute: kept experts}}`` for the router, the experts module and
    the layer of each expert gate among ``masks`` that removed any: every attribute of
    ``COUNT_ATTRIBUTES`` they hold as an int equal to the layer's expert count. When every
    layer had and keeps the same count, the model's own such attributes too (a Hugging Face
    causal LM's ``num_experts``, read by its load-balancing loss).

    Raises:
        ValueError: a layer keeps fewer experts than the ``top_k`` each token is routed to.
    """
    gates = [m for m in masks.values() if isinstance(m, ExpertGate)]
    out: dict[str, dict[str, int]] = {}
    for m in gates:
        if m.kept < m.min_kept:
            raise ValueError(
                f"the MoE layer {m.layer_path} keeps {m.kept} experts, fewer than the "
                f"{m.min_kept} each token is routed to: set gate entries back to 1 (prune "
                "never goes below that floor)"
            )
        if m.kept < m.num_channels:
            for path in (m.router_path, m.experts_path, m.layer_path):
                _set_counts(out, path, model.get_submodule(path), m.num_channels, m.kept)
    if out and len({(m.num_channels, m.kept) for m in gates}) == 1:
        _set_counts(out, "", model, gates[0].num_channels, gates[0].kept)
    return out


def _set_counts(
    out: dict[str, dict[str, int]], path: str, mod: nn.Module, count: int, kept: int
) -> None:
    """Set ``out[path][attr] = kept`` for each count attribute of ``mod`` that is ``count``."""
    for attr in COUNT_ATTRIBUTES:
        if type(getattr(mod, attr, None)) is int and getattr(mod, attr) == count:
            out.setdefault(path, {})[attr] = kept
