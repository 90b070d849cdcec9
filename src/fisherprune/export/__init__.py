"""Export: the physically smaller network, its pruning plan, and files to serve it."""

from fisherprune.export.aoti import AOTIModule, load_aoti_export
from fisherprune.export.files import FORMATS, export_model, load_state_dict_export
from fisherprune.export.hf_uniform import refine_for_config  # noqa: F401 (registers it)
from fisherprune.export.latency import (
    allocator_state,
    compare_latency,
    frozen_for_serving,
    measure_latency,
    retain_freed_memory,
)
from fisherprune.export.latency_stats import LatencyComparison, LatencyDistribution, SpeedUp
from fisherprune.export.manifest import ExportMismatchError, verify_export
from fisherprune.export.mha import PrunedMultiheadAttention
from fisherprune.export.modules import register_shrink_rule, unregister_shrink_rule
from fisherprune.export.plan import PlanMismatchError, PruningPlan
from fisherprune.export.safe_load import PickledObjectsError
from fisherprune.export.serving_forms import serve as _serve  # noqa: F401 (registers it)
from fisherprune.export.shrink import ShrinkError, shrink
from fisherprune.export.width_probe import shrink_trial as _shrink_trial  # noqa: F401

__all__ = [
    "FORMATS",
    "AOTIModule",
    "ExportMismatchError",
    "LatencyComparison",
    "LatencyDistribution",
    "PickledObjectsError",
    "PlanMismatchError",
    "PrunedMultiheadAttention",
    "PruningPlan",
    "ShrinkError",
    "SpeedUp",
    "allocator_state",
    "compare_latency",
    "export_model",
    "frozen_for_serving",
    "load_aoti_export",
    "load_state_dict_export",
    "measure_latency",
    "register_shrink_rule",
    "retain_freed_memory",
    "shrink",
    "unregister_shrink_rule",
    "verify_export",
]
