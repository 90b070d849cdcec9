"""``--init_from``: start ``fisherprune train`` from weights the user trained already.

The file is a state_dict (``torch.save(model.state_dict(), path)``) of the model that
``--model`` builds, a checkpoint written by ``fisherprune train`` (its ``model`` entry; its
masks and pruning signals then come along), or the dense model such a run exported
(``EXPORT_DIR/dense.pt``: a state_dict export, its ``state_dict`` entry). It is read as
tensors and plain data only (``weights_only``): a file of pickled objects is refused before
anything from it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from fisherprune.export.safe_load import load_plain
from fisherprune.masks import MaskLayer

__all__ = ["load_pretrained", "misfit"]

_REMEDY = "save the weights with torch.save(model.state_dict(), path), which holds tensors only"
_SHOWN = 8  # keys named in a mismatch message, per kind


def _state_dict_of(path: Path) -> dict[str, Tensor]:
    """The weights in ``path``: the file itself, or a checkpoint's ``model`` entry.

    Raises:
        FileNotFoundError: no such file.
        ValueError: pickled objects, a file that holds no tensors by name, or a checkpoint
            of a shrunk model.
    """
    if not path.is_file():
        raise FileNotFoundError(f"--init_from {path} does not exist")
    loaded: Any = load_plain(path, "--init_from file", _REMEDY)
    if isinstance(loaded, dict) and isinstance(loaded.get("model"), dict):
        if loaded.get("pruner", {}).get("shrunk", False):
            raise ValueError(
                f"--init_from {path} is a checkpoint written while its run fine-tuned the "
                "shrunk model: its weights have lost the pruned channels, and --model builds "
                "the dense one; give a checkpoint written before the fine-tuning, or the "
                "dense model that run exported (EXPORT_DIR/dense.pt)"
            )
        loaded = loaded["model"]  # a fisherprune checkpoint
    elif isinstance(loaded, dict) and set(loaded) == {"state_dict", "plan"}:
        if (loaded["plan"] or {}).get("modules"):  # (a plan that removes channels)
            raise ValueError(
                f"--init_from {path} is the export of a pruned model: its weights have lost "
                "the pruned channels, and --model builds the dense one; give the dense model "
                "that run exported (EXPORT_DIR/dense.pt)"
            )
        loaded = loaded["state_dict"]  # a state_dict export of the dense model
    if not isinstance(loaded, dict) or not all(isinstance(v, Tensor) for v in loaded.values()):
        raise ValueError(
            f"--init_from {path} holds no state_dict (a dict of parameter name -> tensor); "
            + _REMEDY
        )
    return loaded


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


_INNER = "model."  # where train.scaling.with_scaling puts the network


def misfit(
    expected: dict[str, Tensor],
    weights: dict[str, Any],
    optional: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
    """What keeps ``weights`` from loading into a model whose state_dict is ``expected``: keys
    missing from the file (those in ``optional`` may be), keys the model lacks, and shapes that
    differ, each kind named (empty if it fits)."""
    missing = sorted(k for k in expected if k not in weights and k not in optional)
    unexpected = sorted(k for k in weights if k not in expected)
    shapes = sorted(
        f"{k} {tuple(weights[k].shape)} (model: {tuple(v.shape)})"
        for k, v in expected.items()
        if k in weights and isinstance(weights[k], Tensor) and weights[k].shape != v.shape
    )
    return [
        f"{label}: {_listed(keys)}"
        for label, keys in (
            ("missing from the file", missing),
            ("not in the model", unexpected),
            ("shapes differ", shapes),
        )
        if keys
    ]


def load_pretrained(model: nn.Module, masks: dict[str, MaskLayer], path: str | Path) -> None:
    """Load the weights of ``path`` into ``model`` (masks attached). Mask states (``mask``,
    ``signal``) are loaded when the file has them (a fisherprune checkpoint) and left as they
    are otherwise. For a network wrapped in this run's feature scaling
    (``train.scaling.with_scaling``), the weights of the bare network load into it and the
    scaling stays as fitted. Changes nothing when the keys or shapes do not match.

    Raises:
        FileNotFoundError: no such file.
        ValueError: pickled objects, no state_dict, or keys / shapes that do not match the
            model (every mismatch is named).
    """
    p = Path(path)
    weights = _state_dict_of(p)
    expected = model.state_dict()
    mask_keys = {f"{name}.{k}" for name, m in masks.items() for k in m.state_dict()}
    inner = [k for k in weights if _INNER + k in expected]
    if "model" in model._modules and inner and not any(k.startswith(_INNER) for k in weights):
        # a model between the scaling modules fitted on this run's table (train.scaling),
        # given the weights of the bare network: they go inside, the scaling stays this run's
        weights = {_INNER + k: v for k, v in weights.items()}
        mask_keys |= {k for k in expected if not k.startswith(_INNER)}
    problems = misfit(expected, weights, optional=mask_keys)
    if problems:
        raise ValueError(
            f"--init_from {p} does not fit the model ({'; '.join(problems)}); give the --model, "
            "--width and --depth it was trained with"
        )
    model.load_state_dict(weights, strict=False)
