"""AOTInductor packages: the shrunk network compiled ahead of time to native CPU code.

``torch.export`` captures the network's graph and AOTInductor compiles it, with its weights as
constants and batch norm folded, into a ``.pt2`` package that runs without Python tracing or
TorchScript (deprecated since torch 2.13). ``load_aoti_export`` loads one as an ``nn.Module``
that checks its inputs, which the compiled code itself does not do.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fisherprune._errors import first_line
from fisherprune.export.layout import ServedInputs, serving_copy
from fisherprune.export.manifest import check_exported_file
from fisherprune.export.plan import PruningPlan
from fisherprune.inputs import Inputs

__all__ = ["AOTIModule", "load_aoti_export", "write_aoti"]

#: key of the package metadata entry this library writes (JSON)
METADATA_KEY = "fisherprune"


def write_aoti(model: nn.Module, inputs: Inputs, tmp: Path, plan: PruningPlan) -> None:
    """Compile ``model`` (eval mode, not changed) for inputs shaped like ``inputs`` (positional
    or keyword ones) with any batch size into the AOTInductor package ``tmp`` (its name ends in
    ``.pt2``).

    Every input's first dimension is the batch, one size for all. Image models (first input
    4-D) are compiled in channels-last layout: their weights in that layout, and a layout change
    of the inputs at the start of the graph. Parallel loops use as many threads as the serving
    process has (``torch.set_num_threads``), not the compiling one. The package records the
    input names (for keyword inputs), shapes and dtypes, the layout and ``plan`` in its
    metadata.

    Raises:
        ValueError: an example input is not a tensor, or the inputs do not share a first
            (batch) dimension.
        RuntimeError: ``torch.export`` cannot capture the model, or AOTInductor cannot compile
            it (no C++ compiler, say); the message says which.
    """
    named = inputs.arguments()
    args = [a for _, a in named]
    if not args or not all(isinstance(a, Tensor) for a in args):
        kinds = ", ".join(type(a).__name__ for a in args) or "none"
        raise ValueError(
            f"format 'aoti' needs every example input to be a tensor (got: {kinds}); "
            "other arguments would be compiled in as constants"
        )
    batches = {a.shape[0] if a.dim() else None for a in args}
    if len(batches) != 1 or None in batches:
        shapes = ", ".join(str(tuple(a.shape)) for a in args)
        raise ValueError(
            "format 'aoti' compiles the first dimension of every input as one batch size, so "
            f"every example input must have it, the same (got shapes {shapes})"
        )
    channels_last = args[0].dim() == 4
    names = [n for n, _ in named] if inputs.keyword else None
    net = ServedInputs(serving_copy(model, channels_last), channels_last, names)
    # batch 2: an example of size 1 would be specialised to 1
    args2 = tuple(a.contiguous() for _, a in inputs.repeated(2).arguments())
    meta = {
        "inputs": [
            {"name": n, "shape": list(a.shape[1:]), "dtype": str(a.dtype)} for n, a in named
        ],
        "keyword": inputs.keyword,
        "channels_last": channels_last,
        "plan": plan.to_dict(),
    }
    # with autograd on, as torch's examples do: compiled under no_grad, freezing miscompiled a
    # channels-last network with a 1-channel input here (torch 2.13; outputs off by 0.3)
    with torch.enable_grad(), warnings.catch_warnings():
        # torch's own pytree code warns of its own deprecation; nothing a caller can change
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        _compile(_capture(net, args2), tmp, meta)


def _capture(net: nn.Module, args: tuple) -> torch.export.ExportedProgram:
    """``torch.export`` of ``net`` with the first dimension of every input dynamic."""
    batch = torch.export.Dim("batch", min=1)
    try:
        return torch.export.export(net, args, dynamic_shapes=(tuple({0: batch} for _ in args),))
    except Exception as e:
        raise RuntimeError(
            f"format 'aoti': torch.export could not capture the model ({first_line(e)}). "
            "Python control flow that depends on tensor values, for one, cannot be exported; "
            "choose format 'torchscript' or 'state_dict' for such a model"
        ) from e


def _compile(program: torch.export.ExportedProgram, tmp: Path, meta: dict[str, Any]) -> None:
    """AOTInductor package of ``program`` at ``tmp``, frozen, ``meta`` in its metadata."""
    try:
        torch._inductor.aoti_compile_and_package(
            program,
            package_path=str(tmp),
            inductor_configs={
                "freezing": True,  # weights become constants; batch norm folds into the convs
                # threads of the serving process, not a count fixed at compile time
                "cpp.dynamic_threads": True,
                "aot_inductor.metadata": {METADATA_KEY: json.dumps(meta)},
            },
        )
    except Exception as e:
        hint = (
            "It needs a working C++ compiler (g++ or clang++; the CXX environment variable, "
            "set before torch is imported, chooses one)"
            if _compiler_problem(e)
            else "Choose format 'torchscript' or 'state_dict' for this model"
        )
        raise RuntimeError(
            f"format 'aoti': AOTInductor could not compile the model ({first_line(e)}). {hint}"
        ) from e


def _compiler_problem(e: BaseException | None) -> bool:
    """Whether ``e`` or an exception it wraps says the C++ compiler is missing or failed."""
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (InvalidCxxCompiler, CppCompileError)):
            return True
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__
    return False


class AOTIModule(nn.Module):
    """An AOTInductor package written by ``export_model(format="aoti")``, as a module.

    Calling it checks the inputs against the shapes and dtypes the package was compiled for
    (any batch size of at least 1) and makes them contiguous, then runs the compiled code.
    The compiled code checks nothing: an input of another shape or memory layout gives wrong
    numbers without an error there.

    Attributes:
        plan: the ``PruningPlan`` of the exported network.
        channels_last: whether the package computes its convolutions in channels-last layout.
        input_names: for a model exported with keyword inputs (a dict of example inputs), their
            names: the module then takes those keywords (``loaded(**inputs)``); None for
            positional inputs.
        path: the package file.
    """

    def __init__(self, compiled: Any, meta: dict[str, Any], path: Path) -> None:
        super().__init__()
        self._compiled = compiled
        # torch's wrapper parses the package's input and output specs again at every call
        # (0.2 ms, a sixth of a small network's latency at batch 1); parse them once here and
        # run the loader directly where this torch version offers it
        loader = getattr(compiled, "loader", None)
        self._run = getattr(loader, "boxed_run", None)
        self._out_spec = None
        if self._run is not None:
            self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1])
        self._inputs = [(tuple(i["shape"]), i["dtype"]) for i in meta["inputs"]]
        #: the keyword names of the inputs, in compiled order; None: positional inputs
        self.input_names: list[str] | None = (
            [i["name"] for i in meta["inputs"]] if meta.get("keyword") else None
        )
        self.plan = PruningPlan.from_dict(meta["plan"])
        self.channels_last = bool(meta["channels_last"])
        self.path = path

    def forward(self, *args: Tensor, **kwargs: Tensor) -> Any:
        """Run the package on its inputs: positional ones, or, for a model exported with
        keyword inputs, the same keywords in any order.

        Raises:
            ValueError: inputs of another number, names, shape (but the batch), dtype or
                device than the package was compiled for, or of different batch sizes.
        """
        flat, labels = self._ordered(args, kwargs)
        name = self.path.name
        for a, label, (shape, dtype) in zip(flat, labels, self._inputs, strict=True):
            if not isinstance(a, Tensor):
                kind = type(a).__name__
                raise ValueError(f"input {label} of {name} must be a tensor, got {kind}")
            if a.dim() != len(shape) + 1 or tuple(a.shape[1:]) != shape or a.shape[0] < 1:
                want = ", ".join(["batch", *map(str, shape)])
                raise ValueError(
                    f"input {label} has shape {tuple(a.shape)}; {name} was compiled for "
                    f"({want}) with a batch of at least 1"
                )
            if str(a.dtype) != dtype:
                raise ValueError(f"input {label} is {a.dtype}; {name} was compiled for {dtype}")
            if a.device.type != "cpu":
                raise ValueError(f"input {label} is on {a.device}; {name} runs on the CPU")
        if len({a.shape[0] for a in flat}) > 1:
            sizes = ", ".join(str(a.shape[0]) for a in flat)
            raise ValueError(f"the inputs of {name} must share one batch size, got {sizes}")
        flat = [a.contiguous() for a in flat]
        if self._run is None:
            return self._compiled(*flat)
        return pytree.tree_unflatten(self._run(flat), self._out_spec)

    def _ordered(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list[Any], list[str]]:
        """The inputs in compiled order, and how messages name each one."""
        name = self.path.name
        if self.input_names is None:
            if kwargs:
                raise ValueError(
                    f"{name} takes positional inputs, got keyword input(s) {', '.join(kwargs)}"
                )
            if len(args) != len(self._inputs):
                raise ValueError(f"{name} takes {len(self._inputs)} input(s), got {len(args)}")
            return list(args), [str(i) for i in range(len(args))]
        if args or set(kwargs) != set(self.input_names):
            given = ", ".join([*(f"#{i}" for i in range(len(args))), *kwargs]) or "none"
            raise ValueError(
                f"{name} takes the keyword inputs {', '.join(self.input_names)}; got {given}"
            )
        return [kwargs[k] for k in self.input_names], [repr(k) for k in self.input_names]


def load_aoti_export(path: str | os.PathLike) -> AOTIModule:
    """Load a package written by ``export_model(format="aoti")``.

    Its metadata is read as JSON; nothing is unpickled. The package itself is compiled native
    code that runs when loaded: load only packages you made or trust.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is an AOTInductor package this library did not write.
        ExportMismatchError: (a ValueError) the manifest of its folder (a ``fisherprune
            train`` export) records other bytes for it: nothing of it ran.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no AOTInductor package at {path}")
    check_exported_file(path)
    compiled = torch._inductor.aoti_load_package(str(path))
    raw = compiled.get_metadata().get(METADATA_KEY)
    if raw is None:
        raise ValueError(
            f"{path} was not written by fisherprune's export_model(format='aoti'); load it with "
            "torch._inductor.aoti_load_package and pass inputs in the layout it was compiled for"
        )
    return AOTIModule(compiled, json.loads(raw), path)
