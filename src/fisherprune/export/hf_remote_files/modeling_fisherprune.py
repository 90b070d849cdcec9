"""Modelling code for a Hugging Face model pruned (by fisherprune) to widths that differ from
block to block, which no standard config can describe.

Loaded by ``transformers`` from the model's folder with ``trust_remote_code=True``; it needs
only ``torch`` and ``transformers``. Each class here is a transformers class (named in the
lines at the end of this file) that, once built from the config, gives its modules the
shapes and attributes recorded in ``config.fisherprune_shrunk``:

    {"architecture": the class the record was taken from,
     "modules": {module path: {"tensors": {name: shape}, "attributes": {name: value}}}}

A class built as the base model of that architecture (``AutoModel``) applies the entries
under its ``base_model_prefix`` only. The parameters and buffers it replaces are empty (on
the device and in the dtype the class made them, the meta device under ``from_pretrained``)
until the folder's weights load into them; built from the config alone they are initialised
by the class's own ``_init_weights``. Tensors that were one object (tied weights) stay one.
The forward code is the transformers class's own.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

RECORD = "fisherprune_shrunk"


def _apply_record(model: nn.Module) -> None:
    """Give ``model``'s modules the recorded shapes and attributes. Changes: the listed
    modules' parameters and buffers (replaced by empty tensors of the new shapes) and
    attributes; those modules are marked for weight initialisation again."""
    record = getattr(model.config, RECORD)
    prefix = ""
    if type(model).__mro__[1].__name__ != record["architecture"]:
        prefix = model.base_model_prefix + "."
    modules = dict(model.named_modules())
    made: dict[int, torch.Tensor] = {}
    for path, entry in record["modules"].items():
        if prefix and not path.startswith(prefix):
            continue  # the head of the architecture, which a base model lacks
        name = path[len(prefix) :]
        if name not in modules:
            raise ValueError(f"{type(model).__name__} has no module {name!r} to resize")
        mod = modules[name]
        for tname, shape in entry.get("tensors", {}).items():
            _resize(mod, tname, shape, made)
        for attr, value in entry.get("attributes", {}).items():
            old = getattr(mod, attr)
            setattr(mod, attr, tuple(value) if isinstance(old, tuple) else value)
        mod.__dict__.pop("_is_hf_initialized", None)  # its tensors are new: initialise them


def _resize(mod: nn.Module, tname: str, shape: list[int], made: dict[int, torch.Tensor]) -> None:
    """Replace ``mod``'s parameter or buffer ``tname`` by an empty one of ``shape`` (the same
    new object for every holder of one old tensor)."""
    store = mod._parameters if tname in mod._parameters else mod._buffers
    old = store[tname]
    new = made.get(id(old))
    if new is None:
        new = torch.empty(shape, dtype=old.dtype, device=old.device)
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        made[id(old)] = new
    store[tname] = new


def pruned_class(base_name: str) -> type:
    """The class ``transformers.<base_name>`` whose modules take the recorded widths, named
    ``FisherPruned<base_name>``."""
    base = getattr(transformers, base_name)

    def post_init(self: nn.Module) -> None:
        _apply_record(self)  # before the weights are initialised and tied
        base.post_init(self)

    return type(
        f"FisherPruned{base_name}", (base,), {"post_init": post_init, "__module__": __name__}
    )


# The classes of this folder (written by fisherprune at export):
