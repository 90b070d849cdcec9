"""Mask-aware norms: normalisation layers whose width may lose channels.

A layer norm or an RMS norm computes statistics across the width it normalises, so removing
one channel changes every other channel's output. Such a width is still prunable when the
norm is registered here: ``apply_masks`` then hooks the norm so that, once the width's mask
has zeros, its statistics are taken over the kept channels only; that is exactly what the
shrunk norm computes. An unregistered norm keeps its width blocked. Register a norm of your
own with::

    fisherprune.register_norm(MyRMSNorm, kind="rms", eps="eps")

(kinds: ``"layer"``, ``"rms"`` and ``"grn"``, ConvNeXt-V2's global response norm; Hugging
Face's and timm's GRN are registered.)

A class of an optional package may be named instead of imported (``"package.module.Class"``,
matched against a module's class by its module and name), so registering it imports nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "NormSpec",
    "detect_norms",
    "norm_spec",
    "normalise_kept",
    "normalise_masked",
    "register_norm",
    "unregister_norm",
]

NormKey = type | str


@dataclass(frozen=True)
class NormSpec:
    """How a registered norm computes its output.

    Attributes:
        kind: ``"layer"``: ``(x - mean) / sqrt(var + eps) * weight + bias``; ``"rms"``:
            ``x / sqrt(mean(x**2) + eps) * weight``; ``"grn"``: ``weight * (x * n) + bias + x``
            with ``n`` each channel's L2 norm over the positions over their mean across
            channels (plus eps, 1e-6 where the module holds none).
        trailing: how many trailing dims it normalises, given the module.
        eps: the attribute holding epsilon (None there: the kind's default, 1e-5 for
            ``"layer"``, 1e-6 for ``"grn"``, ``torch.finfo(dtype).eps`` for ``"rms"``).
        weight, bias: the attributes holding the affine parameters (absent or None: none).
        dtype: for ``"rms"``, the dtype it normalises in before casting back to the input's
            and applying the weight (Hugging Face's: float32), or None: the input's.
        weight_offset: added to the weight before it scales (Gemma's ``1 + weight``).
        scale_in_dtype: for ``"rms"``, the weight scales in ``dtype`` before the cast back
            (Gemma's order) rather than after it (LLaMA's).
        channel_dim: the module's attribute holding the one dim of its input it normalises
            across (timm's GRN: ``channel_dim``, 1 on channels-first maps, -1 on channels-last
            ones), or None: the ``trailing`` dims.
    """

    kind: str
    trailing: Callable[[nn.Module], int]
    eps: str = "eps"
    weight: str = "weight"
    bias: str = "bias"
    dtype: torch.dtype | None = None
    weight_offset: float = 0.0
    scale_in_dtype: bool = False
    channel_dim: str | None = None

    def normalised_dim(self, module: nn.Module) -> int | None:
        """The one dim of its input ``module`` normalises across, where ``channel_dim``
        names the attribute saying it (negative counts from the end), else None.

        Raises:
            ValueError: ``module`` holds no int under that name (the registration names
                another attribute than the one its class keeps the dim in)."""
        if self.channel_dim is None:
            return None
        value = getattr(module, self.channel_dim, None)
        if type(value) is not int:
            raise ValueError(
                f"{type(module).__name__} is registered as a norm across the dim held in its "
                f"attribute {self.channel_dim!r}, but it holds {value!r} there, not a dim: "
                "register it with channel_dim naming the int attribute that holds the dim it "
                "normalises"
            )
        return value


_BY_CLASS: dict[type, NormSpec] = {}
_BY_NAME: dict[str, NormSpec] = {}


def register_norm(
    key: NormKey,
    *,
    kind: str,
    eps: str = "eps",
    weight: str = "weight",
    bias: str = "bias",
    trailing: int | Callable[[nn.Module], int] = 1,
    dtype: torch.dtype | None = None,
    channel_dim: str | None = None,
) -> None:
    """Declare modules of class ``key`` (or named ``"package.module.Class"``) mask-aware norms.

    Changes: adds the entry to the registry; models traced afterwards may prune the width such
    a norm normalises (its weight and bias follow the width). It applies to modules of exactly
    this class: a subclass may normalise differently (a channels-first ``LayerNorm2d`` permutes
    first), so it needs its own entry.

    Args:
        key: the class, or its qualified name (``"package.module.Class"``).
        kind: ``"layer"`` (mean and variance), ``"rms"`` (root mean square) or ``"grn"``
            (ConvNeXt-V2's global response norm of channels-last maps: each channel's L2 norm
            over the positions over its mean across the channels, ``n``, gives
            ``weight * (x * n) + bias + x``; weight and bias may be shaped (1, ..., 1, C)).
        eps, weight, bias: the module's attributes holding epsilon and the affine parameters.
        trailing: how many trailing dims it normalises, or a function of the module saying so.
        dtype: for ``"rms"``, the dtype it computes in (None: the input's); the result is cast
            back to the input's dtype before the weight multiplies it.
        channel_dim: for a norm over one dim that need not be the last (a GRN that works on
            channels-first maps as well), the module's attribute holding that dim.

    Raises:
        ValueError: an unknown ``kind``, a malformed name, or a key already registered.
        TypeError: a key that is neither a class nor a string.
    """
    if kind not in _KINDS:
        raise ValueError(f"register_norm: kind must be one of {sorted(_KINDS)}, got {kind!r}")
    _check_key(key)
    if key in _BY_CLASS or key in _BY_NAME:
        raise ValueError(f"{_key_name(key)} is already a registered norm")
    dims = trailing if callable(trailing) else (lambda _m, k=int(trailing): k)
    spec = NormSpec(kind, dims, eps, weight, bias, dtype, channel_dim=channel_dim)
    if isinstance(key, str):
        _BY_NAME[key] = spec
    else:
        _BY_CLASS[key] = spec


def unregister_norm(key: NormKey) -> None:
    """Remove the entry registered under exactly ``key``; its width is blocked again.

    Raises:
        ValueError: ``key`` is not registered.
    """
    if key in _BY_CLASS:
        del _BY_CLASS[key]  # type: ignore[arg-type]
    elif key in _BY_NAME:
        del _BY_NAME[key]  # type: ignore[arg-type]
    else:
        raise ValueError(f"{_key_name(key)} is not a registered norm")


def norm_spec(module: nn.Module | None) -> NormSpec | None:
    """The registry's entry for ``module``'s exact class (or the one ``detect_norms`` found
    for it), or None."""
    if module is None:
        return None
    cls = type(module)
    found = _BY_CLASS.get(cls) or _DETECTED.get(cls)
    if found is not None:
        return found
    return _BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")


#: classes found by their behaviour to be norms (None: tried, not one)
_DETECTED: dict[type, NormSpec | None] = {}
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
#: the forms a norm is tried against, in order
_FORMS = (
    NormSpec("rms", lambda _m: 1, dtype=torch.float32),
    NormSpec("rms", lambda _m: 1, dtype=torch.float32, weight_offset=1.0, scale_in_dtype=True),
    NormSpec("layer", lambda _m: 1),
)


def detect_norms(model: nn.Module) -> dict[str, str]:
    """Find unregistered normalisation layers by what they compute, so that models written by
    others (each Hugging Face model family has its own ``XxxRMSNorm`` class) need no
    ``register_norm``.

    A candidate is a module of a class outside ``torch.nn`` whose name contains "Norm", with no
    children, a 1-d ``weight`` and an epsilon attribute (``variance_epsilon``, ``eps`` or
    ``epsilon``). It is run once per class on random data with a random weight (and bias),
    restored afterwards, channels last and then channels first, and compared with an RMS norm
    (``x / sqrt(mean(x^2) + eps) * w``, computed in float32 as Hugging Face's are), Gemma's RMS
    norm (``* (1 + w)``) and a layer norm over the channels; the first that matches to 1e-5
    becomes its entry.

    Changes: the detected classes' entries (``norm_spec`` finds them); the model is unchanged.

    Returns:
        ``{class name: form}`` for every class detected in this call.
    """
    found: dict[str, str] = {}
    for mod in model.modules():
        cls = type(mod)
        if cls in _DETECTED or norm_spec(mod) is not None or not _candidate(mod):
            continue
        spec = _DETECTED[cls] = _match(mod)
        if spec is not None:
            found[cls.__name__] = spec.kind + (" (1 + weight)" if spec.weight_offset else "")
    return found


def _candidate(mod: nn.Module) -> bool:
    w = getattr(mod, "weight", None)
    return (
        "Norm" in type(mod).__name__
        and not type(mod).__module__.startswith("torch.")
        and next(mod.children(), None) is None
        and isinstance(w, Tensor)
        and w.dim() == 1
        and any(isinstance(getattr(mod, e, None), float) for e in _EPS_NAMES)
    )


def _match(mod: nn.Module) -> NormSpec | None:
    """The first of ``_FORMS`` that ``mod`` computes, or None. It is tried on channels last,
    (2, 3, C), then on channels first, (2, C, 3, 3) and (2, C, 3): a ``LayerNorm2d``
    (ConvNeXt's, as Hugging Face and timm write it) permutes its channels last and back, one
    class may serve both layouts (Hugging Face's ``data_format``), and SqueezeBERT's norm does
    so for its (N, C, L) sequences. It runs in eval mode, and its parameters and buffers are
    restored afterwards (a batch norm subclass in training mode would update its running
    statistics from the probe)."""
    eps = next(e for e in _EPS_NAMES if isinstance(getattr(mod, e, None), float))
    params = [t for t in (mod.weight, getattr(mod, "bias", None)) if isinstance(t, Tensor)]
    state = [*params, *(b for b in mod.buffers(recurse=False) if isinstance(b, Tensor))]
    saved = [t.detach().clone() for t in state]
    training = mod.training
    g = torch.Generator().manual_seed(0)
    width = mod.weight.numel()
    try:
        mod.eval()
        with torch.no_grad():
            for t in params:
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
            for shape, dim in (((2, 3, width), -1), ((2, width, 3, 3), 1), ((2, width, 3), 1)):
                x = torch.randn(shape, generator=g).to(mod.weight)
                spec = _form_of(mod, x, dim, eps)
                if spec is not None:
                    return spec
    finally:
        mod.train(training)
        with torch.no_grad():
            for t, v in zip(state, saved, strict=True):
                t.copy_(v)
    return None


def _form_of(mod: nn.Module, x: Tensor, dim: int, eps: str) -> NormSpec | None:
    """The first of ``_FORMS`` whose output over ``dim`` of ``x`` is ``mod``'s, or None (a
    module that does not take one tensor of this layout, or gives another shape)."""
    try:
        out = mod(x)
        if not isinstance(out, Tensor) or out.shape != x.shape:
            return None
        idx = torch.arange(x.shape[dim], device=x.device)
        for form in _FORMS:
            spec = replace(form, eps=eps)
            if torch.allclose(out, normalise_kept(mod, spec, x, dim, idx), rtol=1e-5, atol=1e-5):
                return spec
    except Exception:  # (its own code refused the probe: not a norm of these forms)
        return None
    return None


def normalise_kept(module: nn.Module, spec: NormSpec, x: Tensor, dim: int, idx: Tensor) -> Tensor:
    """The norm's output on ``x`` as the shrunk norm computes it, in one pass over the kept
    channels: normalised over ``x``'s kept positions along ``dim`` (one of the normalised dims;
    ``idx``: the kept positions, ascending), with the kept entries of the weight and bias. The
    other positions are zeros (their channels are pruned: every reader of them is masked).
    A norm over one dim normalises ``dim`` wherever it is (a channels-first ``LayerNorm2d``:
    the channels of an (N, C, H, W) input)."""
    k = spec.trailing(module)
    if k == 1 and (d := dim % x.dim()) != x.dim() - 1:
        return normalise_kept(module, spec, x.movedim(d, -1), -1, idx).movedim(-1, d)
    xk = x.index_select(dim, idx)
    wdim = dim % x.dim() - (x.dim() - k)
    weight, bias = _affine(module, spec, k)
    weight = weight.index_select(wdim, idx) if weight is not None else None
    bias = bias.index_select(wdim, idx) if bias is not None else None
    y = _KINDS[spec.kind].kept(xk, weight, bias, getattr(module, spec.eps, None), spec, k)
    if idx.numel() == x.shape[dim]:
        return y  # every position kept
    return y.new_zeros(x.shape).index_copy_(dim, idx, y)


def normalise_masked(
    module: nn.Module, spec: NormSpec, x: Tensor, dim: int, keep: Tensor
) -> Tensor:
    """``normalise_kept`` in a form a compiler fuses whole: the statistics are sums weighted
    by ``keep`` (1 for a kept position of ``dim``, 0 for a pruned one; shape
    ``(x.shape[dim],)``) rather than taken over gathered positions, so no index is computed
    from the mask's values and no shape depends on them. The pruned positions are zeros, the
    kept ones what the shrunk norm gives (equal to ``normalise_kept`` up to rounding)."""
    k = spec.trailing(module)
    if k == 1 and (d := dim % x.dim()) != x.dim() - 1:  # (as ``normalise_kept``)
        return normalise_masked(module, spec, x.movedim(d, -1), -1, keep).movedim(-1, d)
    nd = x.dim()
    d = dim % nd
    dims = tuple(range(nd - k, nd))
    shape = [1] * nd
    shape[d] = x.shape[d]
    weight, bias = _affine(module, spec, k)
    width = keep.sum(dtype=torch.float32)  # (a float16 count rounds above 2048)
    for i in dims:
        width = width * (x.shape[i] if i != d else 1)
    eps = getattr(module, spec.eps, None)
    return _KINDS[spec.kind].masked(x, keep.view(shape), width, weight, bias, eps, spec, dims)


def _affine(module: nn.Module, spec: NormSpec, k: int) -> tuple[Tensor | None, Tensor | None]:
    """The norm's weight (plus ``weight_offset``) and bias shaped as the ``k`` dims it
    normalises (a GRN's (1, 1, 1, C) as (C,)), or None where it has none."""
    weight = getattr(module, spec.weight, None)
    bias = getattr(module, spec.bias, None)
    weight = weight.reshape(weight.shape[-k:]) if isinstance(weight, Tensor) else None
    bias = bias.reshape(bias.shape[-k:]) if isinstance(bias, Tensor) else None
    weight = weight + spec.weight_offset if weight is not None and spec.weight_offset else weight
    return weight, bias


def _layer_kept(x: Tensor, w: Tensor | None, b: Tensor | None, eps: Any, spec: NormSpec, k: int):
    eps = 1e-5 if eps is None else float(eps)
    return F.layer_norm(x, tuple(x.shape[x.dim() - k :]), w, b, eps)


def _rms_kept(x: Tensor, w: Tensor | None, b: Tensor | None, eps: Any, spec: NormSpec, k: int):
    xf = x.to(spec.dtype) if spec.dtype is not None else x
    eps = torch.finfo(xf.dtype).eps if eps is None else float(eps)
    dims = tuple(range(x.dim() - k, x.dim()))
    y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    if spec.scale_in_dtype and w is not None:
        y, w = y * w.to(y.dtype), None
    y = y.to(x.dtype)
    y = y * w if w is not None else y
    return y + b if b is not None else y


def _grn_kept(x: Tensor, w: Tensor | None, b: Tensor | None, eps: Any, spec: NormSpec, k: int):
    """ConvNeXt-V2's global response norm of channels-last ``x`` (N, ..., C): each channel's
    L2 norm over the positions, divided by its mean over the channels, scales the channel;
    ``w * (x * n) + b + x``."""
    eps = 1e-6 if eps is None else float(eps)
    g = torch.linalg.vector_norm(x, 2, dim=tuple(range(1, x.dim() - 1)), keepdim=True)
    y = x * (g / (g.mean(-1, keepdim=True) + eps))
    y = y * w if w is not None else y
    return (y + b if b is not None else y) + x


def _layer_masked(x, kf, width, w, b, eps, spec, dims):  # type: ignore[no-untyped-def]
    eps = 1e-5 if eps is None else float(eps)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    kf = kf.to(xf.dtype)
    mean = (xf * kf).sum(dims, keepdim=True) / width
    centred = (xf - mean) * kf
    var = (centred * centred).sum(dims, keepdim=True) / width
    y = centred * torch.rsqrt(var + eps)
    y = y * w if w is not None else y
    y = y + b * kf if b is not None else y
    return y.to(x.dtype)


def _rms_masked(x, kf, width, w, b, eps, spec, dims):  # type: ignore[no-untyped-def]
    xf = x.to(spec.dtype) if spec.dtype is not None else x
    kx = kf.to(xf.dtype)
    eps = torch.finfo(xf.dtype).eps if eps is None else float(eps)
    y = xf * kx * torch.rsqrt((xf * xf * kx).sum(dims, keepdim=True) / width + eps)
    if spec.scale_in_dtype and w is not None:
        y, w = y * w.to(y.dtype), None
    y = y.to(x.dtype)
    y = y * w if w is not None else y
    return y + b * kf.to(y.dtype) if b is not None else y


def _grn_masked(x, kf, width, w, b, eps, spec, dims):  # type: ignore[no-untyped-def]
    """(The per-channel norms and their mean in float32, the activation in its own dtype: a
    float16 sum of thousands of channels' norms overflows, where the kept form's ``mean``
    accumulates in float32.)"""
    eps = 1e-6 if eps is None else float(eps)
    wide = torch.promote_types(x.dtype, torch.float32)
    g = torch.linalg.vector_norm(x, 2, dim=tuple(range(1, x.dim() - 1)), keepdim=True, dtype=wide)
    n = g / ((g * kf.to(wide)).sum(-1, keepdim=True) / width + eps)  # (N, 1, ..., 1, C)
    y = x * n.to(x.dtype)
    y = y * w if w is not None else y
    return ((y + b if b is not None else y) + x) * kf.to(x.dtype)


@dataclass(frozen=True)
class _Kind:
    """How one kind of norm computes over the kept channels: gathered (``kept``: the kept
    slice, its weight and bias, the module's epsilon or None) and weighted by the kept
    positions (``masked``: the input, the 0/1 keep multiplier shaped to broadcast, the kept
    width, the weight, bias and epsilon, the normalised dims)."""

    kept: Callable[..., Tensor]
    masked: Callable[..., Tensor]


#: the norm kinds ``register_norm`` accepts, by name
_KINDS: dict[str, _Kind] = {
    "layer": _Kind(_layer_kept, _layer_masked),
    "rms": _Kind(_rms_kept, _rms_masked),
    "grn": _Kind(_grn_kept, _grn_masked),
}


def _check_key(key: object) -> None:
    if isinstance(key, str):
        if "." not in key or not all(p.isidentifier() for p in key.split(".")):
            raise ValueError(f"norm key {key!r}: expected a class or 'package.module.Class'")
    elif not isinstance(key, type):
        raise TypeError(f"a norm key is a class or 'package.module.Class', got {key!r}")


def _key_name(key: NormKey) -> str:
    return key if isinstance(key, str) else key.__name__


register_norm(nn.LayerNorm, kind="layer", trailing=lambda m: len(m.normalized_shape))
if hasattr(nn, "RMSNorm"):
    register_norm(nn.RMSNorm, kind="rms", trailing=lambda m: len(m.normalized_shape))
for _hf in (
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
    "transformers.models.t5.modeling_t5.T5LayerNorm",
):
    register_norm(_hf, kind="rms", eps="variance_epsilon", dtype=torch.float32)
# its epsilon (1e-6) is written into its forward, as the kind's default
register_norm("transformers.models.convnextv2.modeling_convnextv2.ConvNextV2GRN", kind="grn")
# timm's, on channels-last maps (ConvNeXt-V2's MLP of linear layers) or channels-first ones
# (its MLP of 1x1 convolutions, ``conv_mlp``), as its ``channel_dim`` says
register_norm("timm.layers.grn.GlobalResponseNorm", kind="grn", channel_dim="channel_dim")
