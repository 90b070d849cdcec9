"""Settings checked against the model before a run trains: what cannot work is refused, and
what the target means is said (a target at the dense cost, or no target at all)."""

from __future__ import annotations

from fisherprune.cost.conventions import cost_unit
from fisherprune.pruner import PruningOptimizer
from fisherprune.pruner.prune import lowest_kept, mask_floor, rounding
from fisherprune.train.config import TrainConfig

__all__ = ["preflight_lines"]


def preflight_lines(config: TrainConfig, popt: PruningOptimizer) -> list[str]:
    """The lines to print before training about the target; reads, changes nothing.

    Raises:
        ValueError: ``pruning_min_channels`` 0 (a layer could lose every channel, and a model
            with an emptied layer cannot be exported by the run).
    """
    if config.pruning_min_channels == 0:
        raise ValueError(
            "pruning_min_channels 0 lets pruning empty a layer, and the run could not export "
            "the result; use 1 or more, or a fraction such as 0.1"
        )
    if popt.target <= 0:
        total = sum(m.num_channels for m in popt.masks.values())
        kept = sum(
            lowest_kept(
                m.kept,
                mask_floor(popt.min_channels, m),
                rounding(m, popt.round_to),
            )
            for m in popt.masks.values()
        )
        return [
            f"target 0: no cost target; pruning every group down to its floor "
            f"(min_channels={config.pruning_min_channels}"
            + (f", round_to={popt.round_to}" if popt.round_to > 1 else "")
            + f"): {kept} of {total} channels kept"
        ]
    if popt.target >= popt.start_cost:
        return [
            f"target {popt.target:,.0f} is at or above the dense cost {popt.start_cost:,.0f} "
            f"{cost_unit(config.pruning_convention)}: nothing will be pruned; the dense model is "
            "trained, fine-tuned and reported"
        ]
    return []
