"""``fisherprune env``: versions and threads, to paste into a bug report."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform

import torch

from fisherprune._version import __version__

__all__ = ["env_command", "env_parser", "env_report"]

_OPTIONAL = (
    "numpy",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "scikit-learn",
    "matplotlib",
    "pyarrow",
    "mlxtend",
    "torch-pruning",
)


def env_report() -> str:
    lines = [
        f"fisherprune: {__version__}",
        f"python: {platform.python_version()} ({platform.python_implementation()})",
        f"platform: {platform.platform()}",
        f"machine: {platform.machine()}, cpus: {os.cpu_count()}",
        f"torch: {torch.__version__} (cuda available: {torch.cuda.is_available()})",
        f"torch threads: {torch.get_num_threads()}, interop: {torch.get_num_interop_threads()}",
        f"distributed: {torch.distributed.is_available()}",
    ]
    for name in _OPTIONAL:
        try:
            lines.append(f"{name}: {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{name}: not installed")
    return "\n".join(lines)


def env_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("env", help="print versions and threads for bug reports")
    p.set_defaults(func=env_command)
    return p


def env_command(args: argparse.Namespace) -> int:
    print(env_report())
    return 0
