"""export_model: write the shrunk network as a state_dict plus its plan, TorchScript, ONNX or an
AOTInductor package."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import io
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fisherprune.export.aoti import write_aoti
from fisherprune.export.layout import ServedInputs
from fisherprune.export.plan import PruningPlan
from fisherprune.export.safe_load import load_plain
from fisherprune.export.shrink import shrink
from fisherprune.export.storage import atomic_save, atomic_write_bytes
from fisherprune.inputs import Inputs
from fisherprune.masks import find_masks
from fisherprune.masks.points import remembered_inputs
from fisherprune.modes import eval_mode

__all__ = ["FORMATS", "default_file_name", "export_model", "load_state_dict_export"]


def export_model(
    model: nn.Module,
    path: str | os.PathLike,
    example_inputs: Any = None,
    format: str = "state_dict",
    *,
    freeze: bool = False,
    plan: PruningPlan | None = None,
) -> Path:
    """Shrink ``model`` if it still has masks, then write it to ``path`` atomically.

    A model shrunk already (``shrink(..., inplace=True)``) has no masks left to read its plan
    off: pass the plan it was shrunk by as ``plan`` (read with ``PruningPlan.from_model``
    before the shrink), and the ``state_dict`` export holds it, so that
    ``load_state_dict_export`` rebuilds the model from a fresh dense one.

    Formats:
        ``"state_dict"``: ``torch.save`` of ``{"state_dict", "plan"}`` (plain tensors
            and JSON-able data; loads with ``weights_only=True``, no pickled classes).
            Rebuild with ``load_state_dict_export(path, fresh_model)``.
        ``"torchscript"``: ``torch.jit.trace`` of the shrunk model in eval mode. With
            ``freeze=True``, ``torch.jit.freeze`` of it: parameters become constants and
            batch norm folds into the preceding conv, so the file serves inference only and
            runs faster on CPU (fewer memory-bound passes; ``docs/benchmarks.md``).
        ``"onnx"``: ONNX (needs the ``onnx`` package: ``pip install fisherprune[onnx]``).
        ``"aoti"``: an AOTInductor package (``path`` must end in ``.pt2``): ``torch.export``
            of the shrunk model compiled ahead of time to native code, weights as constants
            and batch norm folded, any batch size; image models (4-D first input) compute in
            channels-last layout but take ordinary inputs. Load it with
            ``fisherprune.export.load_aoti_export(path)``, which checks inputs. Needs a C++
            compiler and takes seconds to a minute. The successor of TorchScript, which
            torch 2.13 deprecates; on CPU about as fast as frozen TorchScript or a little
            faster (``benchmarks/serve_forms.py``, ``docs/benchmarks.md``).

    The file is written whole or not at all; a failure leaves no partial file and
    leaves an existing file at ``path`` as it was. The masked model is not changed.

    Returns:
        The path written.

    Raises:
        ValueError: unknown format, no example inputs, ``freeze`` with another format
            than TorchScript, an ``aoti`` path not ending in ``.pt2``, or ``plan`` given with
            a model that still has masks (its own plan is read off it).
        ImportError: ONNX requested without the onnx package.
        FileNotFoundError: the target directory does not exist.
        IsADirectoryError: ``path`` is a directory.
        OSError: the file could not be written (a full disk: ENOSPC); it names ``path``, and
            no partial file is left.
        RuntimeError: ``aoti``: the model cannot be exported or compiled (the message says
            which and why).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    if not isinstance(freeze, bool):
        raise TypeError(f"freeze must be True or False, got {freeze!r}")
    if freeze and format != "torchscript":
        raise ValueError(f"freeze=True applies to the torchscript format only, not {format!r}")
    path = Path(path)
    if format == "aoti" and path.suffix != ".pt2":
        raise ValueError(f"an AOTInductor package is a .pt2 file; {path.name} does not end in .pt2")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory; give a file name", str(path))
    if format == "onnx" and importlib.util.find_spec("onnx") is None:
        raise ImportError("ONNX export needs the onnx package: pip install 'fisherprune[onnx]'")
    masked = bool(find_masks(model))
    if masked and plan is not None:
        raise ValueError(
            "plan= is for a model shrunk already; this one still has masks, and its plan is "
            "read off them: leave plan out"
        )
    if masked:
        example_inputs = remembered_inputs(model, example_inputs)
        plan = PruningPlan.from_model(model, example_inputs)
        small = shrink(model, example_inputs)
    else:
        if example_inputs is None and format != "state_dict":
            raise ValueError(f"{format} export needs example_inputs for an unmasked model")
        plan, small = plan or PruningPlan(), model
    with eval_mode(small):  # the caller's model when unmasked: its flags are given back
        _write(small, path, example_inputs, format, plan, freeze)
    return path


def _write(
    small: nn.Module,
    path: Path,
    example_inputs: Any,
    format: str,
    plan: PruningPlan,
    freeze: bool = False,
) -> None:
    inputs = Inputs.of(example_inputs if example_inputs is not None else ())
    with _without_cache(small):
        _FORMATS[format].write(small, path, inputs, plan, freeze)


@contextlib.contextmanager
def _without_cache(model: nn.Module) -> Iterator[None]:
    """A Hugging Face model's ``config.use_cache`` off while it is written, and given back: a
    decoder's key/value cache is state that a traced graph cannot carry (``torch.export``
    refuses its class, TorchScript and ONNX its outputs), so the file serves whole sequences
    and returns the logits."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def _state_dict(
    small: nn.Module, path: Path, inputs: Inputs, plan: PruningPlan, freeze: bool
) -> None:
    state = {k: v.detach().cpu() for k, v in small.state_dict().items()}
    payload = {"state_dict": state, "plan": plan.to_dict()}
    atomic_write_bytes(path, _serialized(lambda f: torch.save(payload, f)))


def _torchscript(
    small: nn.Module, path: Path, inputs: Inputs, plan: PruningPlan, freeze: bool
) -> None:
    scripted = traced(small, inputs, freeze)
    # into memory first: torch.jit.save's own file writer aborts the process on a full disk
    atomic_write_bytes(path, _serialized(lambda f: torch.jit.save(scripted, f)))


def _serialized(save: Callable[[io.BytesIO], None]) -> memoryview:
    """The bytes ``save`` writes into a buffer. Files are written from memory by
    ``atomic_write_bytes``, so that a full disk is an ``OSError`` naming the file (torch's C++
    writers report it as "unexpected pos" or abort the process)."""
    buf = io.BytesIO()
    save(buf)
    return buf.getbuffer()  # no copy


def _onnx_file(
    small: nn.Module, path: Path, inputs: Inputs, plan: PruningPlan, freeze: bool
) -> None:
    atomic_save(path, lambda tmp: _onnx(small, inputs, tmp))


def _aoti_file(
    small: nn.Module, path: Path, inputs: Inputs, plan: PruningPlan, freeze: bool
) -> None:
    atomic_save(path, lambda tmp: write_aoti(small, inputs, tmp, plan), suffix=".pt2")


@dataclass(frozen=True)
class _Format:
    #: (shrunk model in eval mode, path, example inputs, plan, freeze) -> writes the file
    write: Callable[[nn.Module, Path, Inputs, PruningPlan, bool], None]
    file_name: str  # what the trainer calls the file in its export directory


_FORMATS: dict[str, _Format] = {
    "state_dict": _Format(_state_dict, "model.pt"),
    "torchscript": _Format(_torchscript, "model.torchscript.pt"),
    "onnx": _Format(_onnx_file, "model.onnx"),
    "aoti": _Format(_aoti_file, "model.pt2"),
}
FORMATS = tuple(_FORMATS)


def default_file_name(format: str) -> str:
    """The file name ``fisherprune train`` gives an export in ``format`` (one of FORMATS)."""
    return _FORMATS[format].file_name


def traced(model: nn.Module, example_inputs: Any, freeze: bool) -> torch.jit.ScriptModule:
    """``torch.jit.trace`` of ``model`` on ``example_inputs`` (a tensor, a tuple of positional
    inputs or a dict of keyword inputs: ``example_kwarg_inputs``, and the traced module takes
    them by keyword or in the order given) without autograd, frozen with ``freeze``
    (parameters become constants, batch norm is folded into the convs). Raises what
    ``torch.jit.trace`` raises for an untraceable model (``RuntimeError``,
    ``torch.jit.TracingCheckError``, ...)."""
    inputs = Inputs.of(example_inputs)
    # strict=False: a dict of outputs (a Hugging Face ModelOutput) is traced as a dict
    with torch.no_grad():
        if inputs.keyword:
            scripted = torch.jit.trace(
                model, example_kwarg_inputs=dict(inputs.kwargs), strict=False
            )
        else:
            scripted = torch.jit.trace(model, inputs.args, strict=False)
        return torch.jit.freeze(scripted) if freeze else scripted


def _onnx(model: nn.Module, inputs: Inputs, tmp: Path) -> None:
    """ONNX with a dynamic batch dimension (traced at batch 2: size 1 would be specialised).
    Keyword inputs become graph inputs of the same names.

    Raises:
        ValueError: the model has an ``nn.LSTM`` with ``proj_size``, which PyTorch's ONNX
            exporter writes without its projection (a file that computes something else).
    """
    projected = [n for n, m in model.named_modules() if isinstance(m, nn.LSTM) and m.proj_size]
    if projected:
        raise ValueError(
            f"ONNX export of an nn.LSTM with proj_size ({', '.join(projected)}): PyTorch's "
            "exporter writes it without its projection, so the file would compute something "
            "else; export 'torchscript' or 'state_dict' instead"
        )
    inputs2 = inputs.repeated(2)
    with torch.no_grad():
        if importlib.util.find_spec("onnxscript") is not None:
            batch = torch.export.Dim("batch", min=1)
            dyn = inputs.map_leaves(lambda _, batched: {0: batch} if batched else None)
            with _quiet_onnx():
                prog = torch.onnx.export(
                    model,
                    inputs2.args,
                    kwargs=inputs2.kwargs or None,
                    dynamo=True,
                    external_data=False,
                    dynamic_shapes=dyn.packed(),
                    verbose=False,
                )
                prog.save(str(tmp))
        else:  # the TorchScript-based exporter, given keyword inputs positionally (see
            # ServedInputs) and naming them after their keywords
            named = inputs.arguments()
            names = [k if inputs.keyword else f"input{k}" for k, _ in named]
            served = ServedInputs(model, False, names) if inputs.keyword else model
            torch.onnx.export(
                served,
                tuple(a for _, a in inputs2.arguments()),
                str(tmp),
                dynamo=False,
                input_names=names,
                dynamic_axes={n: {0: "batch"} for n in names},
            )


@contextlib.contextmanager
def _quiet_onnx() -> Iterator[None]:
    """Silence the exporter's progress prints and its warnings about absent torchvision ops."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.onnx._internal")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)


def load_state_dict_export(path: str | os.PathLike, model: nn.Module) -> nn.Module:
    """Rebuild an exported ``state_dict`` model: shrink the fresh ``model`` by the saved plan
    (in place) and load the weights. Nothing is unpickled but tensors and plain data
    (``torch.load(..., weights_only=True)``).

    Raises:
        PickledObjectsError: (a ValueError) the file holds pickled Python objects; nothing
            from it ran and ``model`` is unchanged.
        PlanMismatchError: ``model`` is not the architecture the plan was made for.
    """
    payload = load_plain(
        path,
        "export",
        "it was not written by export_model(format='state_dict'): export the model again with "
        "export_model, which writes tensors and plain data only",
    )
    plan = PruningPlan.from_dict(payload["plan"])
    plan.apply(model)
    model.load_state_dict(payload["state_dict"])
    return model
