"""Pruning signals: the Fisher signal gathered by masks."""

from fisherprune.signals.fisher import LOSS_REDUCTIONS, METHODS, update_pruning_signals

__all__ = ["LOSS_REDUCTIONS", "METHODS", "update_pruning_signals"]
