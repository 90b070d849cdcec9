"""A Hugging Face folder for a model whose blocks keep different widths: the config as it was
(the dense widths), a record of what the shrunk model changed, and a modelling file that
rebuilds it from the record, loaded with ``trust_remote_code=True`` (as checkpoints with a
width per layer, such as NVIDIA's DeciLM-style models, ship theirs).

The record is read by comparing the shrunk model with the dense model its config builds (on
the meta device: no memory for weights): for each module, the parameters and buffers whose
shape changed and the plain attributes (numbers, flags, tuples of them) that differ, whatever
their names; nothing is listed by hand. The modelling file
(``hf_remote_files/modeling_fisherprune.py``, which imports only ``torch`` and
``transformers``) gets one line per class the folder serves: the model's own class and its
base model (``AutoModel``), each a subclass of the transformers class that applies the record
after building. ``auto_map`` points the model's Auto classes at them; ``architectures`` names
the model's.

Nothing here imports ``transformers`` at module level (only ``remote_files`` does, when
called): the rest of fisherprune runs without it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fisherprune._errors import first_line

__all__ = ["MODELLING_FILE", "RECORD_FIELD", "RemoteCode", "remote_code", "write_remote_code"]

#: the modelling file's name in the folder, and the config field holding the record (the
#: modelling file reads the same name)
MODELLING_FILE = "modeling_fisherprune.py"
RECORD_FIELD = "fisherprune_shrunk"
_PREFIX = "FisherPruned"
_PLAIN = (bool, int, float)
#: the Auto class that also loads models made for a task (T5's and GPT-2's LM heads): the
#: task's own one is the model's, where both load it
_GENERIC = "AutoModelForPreTraining"


@dataclass(frozen=True)
class RemoteCode:
    """What a remote-code folder for a shrunk model holds: the record of its shapes and
    attributes, the transformers classes it serves by the Auto class that loads each, and the
    Auto class matching the model itself."""

    record: dict[str, Any]
    classes: dict[str, str]  # Auto class name -> transformers class name
    auto_class: str

    def class_name(self, auto: str) -> str:
        """The modelling file's class that ``auto`` loads."""
        return _PREFIX + self.classes[auto]


def remote_code(small: nn.Module) -> RemoteCode | str:
    """What the remote-code folder for the shrunk Hugging Face model ``small`` would hold, or
    why there can be none. ``small.config`` must still describe the dense model (the config
    ``update_config`` could not rewrite). Changes nothing."""
    import transformers

    name = type(small).__name__
    if getattr(transformers, name, None) is not type(small):
        return f"{name} is not a class of transformers itself, which the modelling file extends"
    try:
        with torch.device("meta"):
            dense = type(small)(copy.deepcopy(small.config))
    except Exception as e:
        return f"{name} cannot be built from its config ({first_line(e)})"
    record = _differences(small, dense)
    if isinstance(record, str):
        return record
    classes = _auto_classes(small, dense, transformers)
    autos = [a for a, c in classes.items() if c == name]
    if not autos:
        return f"no Auto class of transformers loads {name}"
    auto = next((a for a in autos if a != _GENERIC), autos[0])
    return RemoteCode({"architecture": name, "modules": record}, classes, auto)


def _differences(small: nn.Module, dense: nn.Module) -> dict[str, dict[str, Any]] | str:
    """Per module path, the tensor shapes and plain attributes of ``small`` that differ from
    ``dense``'s, or why ``small`` is not ``dense`` resized."""
    built = dict(dense.named_modules())
    record: dict[str, dict[str, Any]] = {}
    for path, mod in small.named_modules():
        other = built.get(path)
        if type(other) is not type(mod):
            kind = "missing" if other is None else type(other).__name__
            return (
                f"module {path!r} is a {type(mod).__name__} where the config builds {kind}: "
                "the modelling file only resizes the config's modules"
            )
        entry: dict[str, Any] = {}
        tensors = _tensor_shapes(mod, other, path)
        if isinstance(tensors, str):
            return tensors
        if tensors:
            entry["tensors"] = tensors
        attributes = {
            a: list(v) if isinstance(v, tuple) else v
            for a, v in vars(mod).items()
            if _plain(v) and not a.startswith("_") and a != "training"
            and a in vars(other) and vars(other)[a] != v
        }  # fmt: skip
        if attributes:
            entry["attributes"] = attributes
        if entry:
            record[path] = entry
    return record


def _tensor_shapes(mod: nn.Module, other: nn.Module, path: str) -> dict[str, list[int]] | str:
    """The shapes of ``mod``'s own parameters and buffers that differ from ``other``'s."""
    mine = {**mod._parameters, **mod._buffers}
    theirs = {**other._parameters, **other._buffers}
    if {k for k, t in mine.items() if t is not None} != {
        k for k, t in theirs.items() if t is not None
    }:
        return f"module {path!r} holds other tensors than the config builds"
    shapes = {}
    for k, t in mine.items():
        if t is None or t.shape == theirs[k].shape:
            continue
        if k in mod._non_persistent_buffers_set:
            return (
                f"{path}.{k} changed shape but is not saved with the weights, so a rebuilt "
                "model could not hold its values"
            )
        shapes[k] = list(t.shape)
    return shapes


def _plain(value: Any) -> bool:
    """Whether ``value`` is a number, a flag, or a tuple of them: what JSON carries back."""
    if isinstance(value, tuple):
        return all(type(v) in _PLAIN for v in value)
    return type(value) in _PLAIN


def _auto_classes(small: nn.Module, dense: nn.Module, transformers: Any) -> dict[str, str]:
    """The Auto classes of ``transformers`` that build ``small``'s class from its config, and
    ``AutoModel`` for its base model (when ``small`` holds it under ``base_model_prefix``).

    Each Auto class's table is its ``_model_mapping`` (the one transformers' own
    ``from_pretrained`` reads; transformers has no public lookup from a model class)."""
    config = type(small.config)
    found: dict[str, str] = {}
    for auto_name in transformers.models.auto.modeling_auto.__all__:
        auto = getattr(transformers, auto_name, None)
        mapping = getattr(auto, "_model_mapping", None)
        if not auto_name.startswith("AutoModel") or mapping is None or config not in mapping:
            continue
        built = mapping[config]
        base = getattr(dense, getattr(small, "base_model_prefix", ""), None)
        if built is type(small) or (auto_name == "AutoModel" and isinstance(base, built)):
            found[auto_name] = built.__name__
    return found


def write_remote_code(folder: Path, code: RemoteCode) -> None:
    """Make the folder that ``save_pretrained`` wrote load with ``trust_remote_code=True``:
    copy the modelling file with a line per class in ``code``, and add to ``config.json`` the
    record, ``auto_map`` and the model's class in ``architectures``.

    Changes: ``folder/config.json``; writes ``folder/modeling_fisherprune.py``.
    """
    template = resources.files("fisherprune.export").joinpath("hf_remote_files", MODELLING_FILE)
    lines = [
        f'{_PREFIX}{base} = pruned_class("{base}")\n' for base in sorted(set(code.classes.values()))
    ]
    (folder / MODELLING_FILE).write_text(template.read_text() + "".join(lines))
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    module = MODELLING_FILE.removesuffix(".py")
    config["auto_map"] = {a: f"{module}.{code.class_name(a)}" for a in sorted(code.classes)}
    config["architectures"] = [code.class_name(code.auto_class)]
    config[RECORD_FIELD] = code.record
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
