"""How the subcommands' ``--help`` shows defaults."""

from __future__ import annotations

import argparse

__all__ = ["DefaultsFormatter"]


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``ArgumentDefaultsHelpFormatter`` that adds ``(default: ...)`` only where
    the default is a value: not for an option without one (None), nor for an on/off flag,
    whose default is its absence."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)
