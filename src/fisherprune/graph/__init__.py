"""Trace a model once and find which tensor indices share a channel."""

from fisherprune.graph import rules as _rules  # noqa: F401  (registers the channel rules)
from fisherprune.graph.channels import ChannelGraph
from fisherprune.graph.rules import register_channel_rule, registered_ops
from fisherprune.graph.trace import Trace, trace_model

__all__ = ["ChannelGraph", "Trace", "register_channel_rule", "registered_ops", "trace_model"]
