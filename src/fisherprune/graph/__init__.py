"""Trace a model once and find which tensor indices share a channel."""

from fisherprune.graph import rules as _rules  # noqa: F401  (registers the channel rules)
from fisherprune.graph import rules_buffers as _rules_buffers  # noqa: F401  (zeros, empty)
from fisherprune.graph import rules_experts as _rules_experts  # noqa: F401  (grouped matmul)
from fisherprune.graph import rules_layout as _rules_layout  # noqa: F401  (roll, pad, index)
from fisherprune.graph import rules_sdpa as _rules_sdpa  # noqa: F401  (fused attention)
from fisherprune.graph.channels import ChannelGraph
from fisherprune.graph.gqa import set_grouped_query_units
from fisherprune.graph.groups import ChannelGroup, Skipped, find_groups
from fisherprune.graph.placement import AppliedMasks, apply_masks, remove_masks
from fisherprune.graph.rules import (
    register_channel_rule,
    registered_ops,
    unregister_channel_rule,
)
from fisherprune.graph.trace import Trace, trace_model

__all__ = [
    "AppliedMasks",
    "ChannelGraph",
    "ChannelGroup",
    "Skipped",
    "Trace",
    "apply_masks",
    "find_groups",
    "register_channel_rule",
    "registered_ops",
    "remove_masks",
    "set_grouped_query_units",
    "trace_model",
    "unregister_channel_rule",
]
