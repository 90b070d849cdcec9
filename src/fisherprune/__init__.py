"""fisherprune: remove whole channels by their Fisher pruning signal weighed against their cost.

Public API (see README.md and docs/usage.md):

    apply_masks, remove_masks         find every prunable channel group and mask it
    MaskLayer, find_masks             masks placed by hand
    update_pruning_signals            fold a batch's Fisher estimate into the signal EMA
    criteria                          Fisher, Taylor, L1, Random and the Criterion base
    computational_cost, CostReport    cost per example and marginal cost per channel
    LatencySpec                       where the "latency" cost convention times operators
    prune, PruneEvent                 zero the channel (or block) with the lowest score
    PruningOptimizer                  SGD (or any optimizer) + signals + pruning schedule
    prune_to_target, PruneResult      prune a trained model from calibration data, no training
    shrink, PruningPlan, export_model the physically smaller network and its files
    save_hf_folder                    a shrunk transformers model as a from_pretrained folder
"""

from fisherprune import criteria
from fisherprune._version import __version__
from fisherprune.calibrate import PruneResult, prune_to_target
from fisherprune.cost import (
    CostModel,
    CostReport,
    LatencySpec,
    computational_cost,
    register_cost_formula,
    unregister_cost_formula,
)
from fisherprune.export import (
    PickledObjectsError,
    PlanMismatchError,
    PruningPlan,
    ShrinkError,
    export_model,
    load_aoti_export,
    load_state_dict_export,
    register_shrink_rule,
    shrink,
    unregister_shrink_rule,
)
from fisherprune.export.hf_folder import save_hf_folder
from fisherprune.graph import (
    AppliedMasks,
    apply_masks,
    register_channel_rule,
    remove_masks,
    set_grouped_query_units,
    unregister_channel_rule,
)
from fisherprune.masks import MaskLayer, find_masks
from fisherprune.norms import register_norm, unregister_norm
from fisherprune.pruner import PruneEvent, PruningOptimizer, prune, score
from fisherprune.signals import update_pruning_signals

__all__ = [
    "AppliedMasks",
    "CostModel",
    "CostReport",
    "LatencySpec",
    "MaskLayer",
    "PickledObjectsError",
    "PlanMismatchError",
    "PruneEvent",
    "PruneResult",
    "PruningOptimizer",
    "PruningPlan",
    "ShrinkError",
    "__version__",
    "apply_masks",
    "computational_cost",
    "criteria",
    "export_model",
    "find_masks",
    "load_aoti_export",
    "load_state_dict_export",
    "prune",
    "prune_to_target",
    "register_channel_rule",
    "register_cost_formula",
    "register_norm",
    "register_shrink_rule",
    "remove_masks",
    "save_hf_folder",
    "score",
    "set_grouped_query_units",
    "shrink",
    "unregister_channel_rule",
    "unregister_cost_formula",
    "unregister_norm",
    "unregister_shrink_rule",
    "update_pruning_signals",
]
