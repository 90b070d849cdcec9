"""A model in the form that serves it, ready to be timed whole (the ``latency`` convention).

The ``latency`` convention times each operator alone in eager, which ranks channels by their
relative cost; a compiled form fuses operators, which such a table cannot see. So every
whole-model timing (the dense total ``CostModel.latency_scale`` is taken from, both sizes
``fisherprune.calibrate.fit_latency_line`` times) is taken on the model in the
``LatencySpec.form`` it is served in, and the scale and the line map the eager operators' sum
to the served form's time. ``serve`` builds that form once; ``whole_model_seconds`` times it.

Forms, built with the project's own exporters:

* ``eager``: the module itself, or a copy shrunk at its masks where it has any (and a copy
  where it lives on another device or dtype);
* ``torchscript``: traced and frozen (``frozen_for_serving``, what
  ``export_model(format="torchscript", freeze=True)`` writes), on the CPU or a GPU;
* ``aoti``: an AOTInductor package (``export_model(format="aoti")``, loaded back), CPU only;
* ``compile``: ``torch.compile`` of the module, on the CPU or a GPU;
* ``cuda_graphs``: one forward pass captured in a CUDA graph and replayed, GPU only.

Every form is built from the model shrunk at its masks, as an export would serve it (a
model with every mask at 1 loses only its masks), eager too: a mask's forward hook costs time
a served model does not spend (on the one-shot suite's CNNs at batch 64, every mask at 1 made
the forward 12-17% slower, a decoder 8%, MiniLM 3%), and a dense price that carried it made
every shrunk state look that much faster than the dense model as served. A model without
masks is timed as given.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fisherprune._errors import first_line
from fisherprune.compile_regions import ISOLATED
from fisherprune.cost.latency import DTYPES, LatencySpec, ServedForm, register_serving
from fisherprune.export.aoti import load_aoti_export
from fisherprune.export.files import export_model
from fisherprune.export.latency import frozen_for_serving
from fisherprune.export.shrink import shrink
from fisherprune.inputs import Inputs
from fisherprune.masks import find_masks

__all__ = ["compile_for_serving", "serve"]

#: untimed forward passes before a CUDA graph is captured (cuDNN and the allocator settle)
CAPTURE_WARMUP = 3


def _placed(model: nn.Module, spec: LatencySpec) -> tuple[nn.Module, Callable[[Any], Any]]:
    """``model`` on ``spec``'s device and dtype (a copy where it is not there already), and
    the function that moves an input leaf there."""
    device, dtype = spec.torch_device, DTYPES.get(spec.dtype) if spec.dtype else None
    params = list(model.parameters())
    here = not params or all(
        p.device == device and (dtype is None or not p.is_floating_point() or p.dtype == dtype)
        for p in params
    )
    if not here:
        model = copy.deepcopy(model).to(device=device, dtype=dtype)

    def move(x: Any, _batched: bool = False) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if dtype is not None and x.is_floating_point():
            return x.to(device=device, dtype=dtype)
        return x.to(device)

    return model, move


def serve(model: nn.Module, example_inputs: Any, spec: LatencySpec) -> ServedForm:
    """``model`` built in ``spec.form`` on ``spec``'s device and dtype, running on
    ``example_inputs`` (moved there). A compiled form is built once here (AOTInductor: 15-25 s
    on a CPU), from a copy shrunk at the model's masks.

    Changes: nothing; ``model`` is copied where a form or a device needs it.

    Raises:
        RuntimeError: the form cannot be built for this model (what the exporter or compiler
            says, with the form named).
    """
    model, move = _placed(model, spec)
    inputs = Inputs.of(example_inputs).map_leaves(move)
    if spec.form == "eager":
        net = _unmasked(model, inputs)
        return ServedForm("eager", lambda: inputs.call(net), module=net)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracers' and compilers' own notices
            net = shrink(model, inputs.packed(), check=False) if find_masks(model) else model
            net = copy.deepcopy(net).eval() if net is model else net.eval()
            return _BUILD[spec.form](net, inputs)
    except Exception as e:
        raise RuntimeError(
            f"LatencySpec.form {spec.form!r}: the model could not be built in this form "
            f"({first_line(e)}); choose another form (eager times any model)"
        ) from e


def _unmasked(model: nn.Module, inputs: Inputs) -> nn.Module:
    """``model`` as served in eager: shrunk at its masks (a copy), or ``model`` itself when it
    has none.

    Raises:
        RuntimeError: the masked model cannot be shrunk (what ``shrink`` says).
    """
    if not find_masks(model):
        return model
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return shrink(model, inputs.packed(), check=False).eval()
    except Exception as e:
        raise RuntimeError(
            f"a masked model is timed as served, shrunk at its masks, and this one could not "
            f"be shrunk ({first_line(e)}); remove_masks(model) to time it as it is"
        ) from e


def _torchscript(net: nn.Module, inputs: Inputs) -> ServedForm:
    frozen, args = frozen_for_serving(net, inputs.packed())
    if isinstance(args, dict):
        return ServedForm("torchscript", lambda: frozen(**args))
    return ServedForm("torchscript", lambda: frozen(*args))


def _aoti(net: nn.Module, inputs: Inputs) -> ServedForm:
    folder = tempfile.TemporaryDirectory(prefix="fisherprune-aoti-")
    path = export_model(net, Path(folder.name) / "served.pt2", inputs.packed(), format="aoti")
    loaded = load_aoti_export(path)
    return ServedForm("aoti", lambda: inputs.call(loaded), keep=[folder])


#: dynamo's limits on the graphs of one ``forward`` and of all, by their names in the torch
#: versions the project supports (the first a version has)
_GRAPH_LIMITS = (
    ("recompile_limit", "cache_size_limit"),
    ("accumulated_recompile_limit", "accumulated_cache_size_limit"),
)


@contextlib.contextmanager
def _graphs_unlimited() -> Iterator[None]:
    """Dynamo's recompile limits lifted while a model is compiled. Every width of one class
    is another graph of the same ``forward``: past the limit (8) torch serves the rest eager,
    with only a log line, and an eager model would be timed as compiled (seen on torch 2.13:
    the ninth width of a two-layer net ran eager). A timed call finds its graph first (the
    cache is searched most recent first), so the many graphs cost a timing nothing."""
    config = torch._dynamo.config
    limits = {}
    for names in _GRAPH_LIMITS:
        name = next((n for n in names if hasattr(config, n)), None)
        if name is not None:
            limits[name] = max(int(getattr(config, name)), 1 << 20)
    with config.patch(limits):
        yield


def compile_for_serving(
    net: nn.Module, call: Callable[[Any], Any], backend: str = "inductor"
) -> Any:
    """``torch.compile(net, backend=backend)`` compiled for the shapes it is timed at
    (``dynamic=False``: a batch or width seen before in this process does not turn it into a
    dynamic-shape graph), by one untimed call ``call(compiled)`` in inference mode, whatever
    graphs the process has compiled before (a count of its own where torch has one,
    ``fisherprune.compile_regions``, and ``_graphs_unlimited``). Changes: dynamo's cache (a
    graph more)."""
    compiled = torch.compile(net, backend=backend, dynamic=False, **ISOLATED)
    with _graphs_unlimited(), torch.inference_mode():
        call(compiled)
    return compiled


def _compile(net: nn.Module, inputs: Inputs) -> ServedForm:
    compiled = compile_for_serving(net, inputs.call)  # compiled here, not when timed
    return ServedForm("compile", lambda: inputs.call(compiled))


def _cuda_graphs(net: nn.Module, inputs: Inputs) -> ServedForm:
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP):
                inputs.call(net)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = inputs.call(net)
    return ServedForm("cuda_graphs", graph.replay, keep=[net, inputs, out])


_BUILD: dict[str, Callable[[nn.Module, Inputs], ServedForm]] = {
    "torchscript": _torchscript,
    "aoti": _aoti,
    "compile": _compile,
    "cuda_graphs": _cuda_graphs,
}


register_serving(serve)
