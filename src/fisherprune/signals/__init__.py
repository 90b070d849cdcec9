"""Pruning signals: the Fisher signal gathered by masks."""

from fisherprune.signals.fisher import LOSS_REDUCTIONS, update_pruning_signals

__all__ = ["LOSS_REDUCTIONS", "update_pruning_signals"]
