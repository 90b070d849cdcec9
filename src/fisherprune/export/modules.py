"""Per-module metadata after slicing: a registry keyed by module class.

After ``PruningPlan.apply`` has sliced a module's parameters and buffers, the
module's rule brings its attributes (``in_channels``, ``num_features``, ``groups``
...) in line with the new shapes. Register a rule for a custom module with::

    @register_shrink_rule(MyLayer)
    def _my_layer(module, old_shapes): module.width = module.weight.shape[0]

A class of an optional package is named instead of imported (``"package.module.Class"``),
as fisherprune does for Hugging Face's ``Conv1D``: the rule applies once a model holding
such a layer is shrunk, and the package is never imported for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

__all__ = [
    "Replacement",
    "ShrinkKey",
    "ShrinkRule",
    "has_shrink_rule",
    "register_replacement",
    "register_shrink_rule",
    "replacement",
    "unregister_shrink_rule",
    "update_metadata",
]

ShrinkRule = Callable[[nn.Module, dict[str, tuple[int, ...]]], None]
ShrinkKey = type | str  # a class, or the qualified name of a module-level class
_RULES: dict[type, ShrinkRule] = {}
_NAMED: dict[str, ShrinkRule] = {}  # by "package.module.Class", resolved when looked up
#: builds the module that takes a sliced module's place, when its class cannot hold the new
#: widths (``nn.MultiheadAttention``: inner width no longer its input width)
Replacement = Callable[[nn.Module], nn.Module]
_REPLACEMENTS: dict[type, Replacement] = {}


def register_shrink_rule(*keys: ShrinkKey) -> Callable[[ShrinkRule], ShrinkRule]:
    """Register ``fn(module, old_shapes)`` for modules of these classes; a subclass with no
    rule of its own uses its nearest registered base class's (along its MRO).

    A key is a class, or the qualified name of a module-level class,
    ``"package.module.Class"`` (``"transformers.pytorch_utils.Conv1D"``), for a layer of an
    optional package: registering a name imports nothing. A name is resolved each time a
    module's metadata is updated, by looking ``Class`` up in ``package.module`` if, and only
    if, that module is already loaded (``sys.modules``): a model holding such a layer has
    loaded it, and a package that is not installed, or installed and not in use, is never
    imported. Once resolved, a name matches exactly as its class would: against the
    module's class and its bases, the nearest registered one winning.

    Changes: adds the rule to the registry, for every model shrunk afterwards.

    Raises:
        ValueError: a key already has a rule (a class and its name count as one key once
            the name resolves), or a string that is not a dotted ``module.Class`` name.
            Nothing is registered then.
        TypeError: a key that is neither a class nor a string.

    Example:
        >>> @register_shrink_rule("mypackage.layers.Mixer")
        ... def _mixer(module, old_shapes): module.width = module.weight.shape[0]
    """
    for key in keys:
        _check_key(key)
        if key in _RULES or key in _NAMED or _same_class_registered(key):
            raise ValueError(f"{_key_name(key)} already has a shrink rule")

    def deco(fn: ShrinkRule) -> ShrinkRule:
        for key in keys:
            if isinstance(key, str):
                _NAMED[key] = fn
            else:
                _RULES[key] = fn
        return fn

    return deco


def unregister_shrink_rule(*keys: ShrinkKey) -> None:
    """Remove the shrink rules registered under exactly these keys (classes or names, as
    registered; not their subclasses').

    The inverse of ``register_shrink_rule`` (for a test's cleanup, or to replace a rule,
    built-in ones included: register the new rule afterwards). A module of such a class then
    follows its nearest registered base class's rule, or keeps its attributes as they are.

    Raises:
        ValueError: a key has no rule of its own (then nothing is removed).
        TypeError: a key that is neither a class nor a string.
    """
    for key in keys:
        _check_key(key)
    missing = [k for k in keys if k not in _RULES and k not in _NAMED]
    if missing:
        raise ValueError(f"{_key_name(missing[0])} has no shrink rule")
    for key in keys:
        if isinstance(key, str):
            del _NAMED[key]
        else:
            del _RULES[key]


def update_metadata(module: nn.Module, old_shapes: dict[str, tuple[int, ...]]) -> None:
    """Apply the rule of ``module``'s class (or its nearest registered base class). A module
    with none keeps its attributes, but for one that holds its 2-D ``weight`` as
    ``nn.Linear`` does, ``(out_features, in_features)`` before the slicing (I-BERT's
    ``QuantLinear``): those two follow the sliced weight, as ``nn.Linear`` 's rule makes
    them (a config written from the shrunk model reads them)."""
    rule = _rule_for(module)
    if rule is not None:
        rule(module, old_shapes)
        return
    weight, before = module._parameters.get("weight"), old_shapes.get("weight")
    widths = (getattr(module, "out_features", None), getattr(module, "in_features", None))
    if weight is not None and weight.dim() == 2 and before is not None and widths == before:
        module.out_features, module.in_features = weight.shape


def register_replacement(*types: type) -> Callable[[Replacement], Replacement]:
    """Register ``fn(module) -> new module`` for sliced modules of exactly these classes:
    ``PruningPlan.apply`` puts what it returns in the module's place (after slicing, metadata
    rules and attributes), keeping the module's parameters and behaviour.

    Raises:
        ValueError: a class already has a replacement.
    """
    for t in types:
        if t in _REPLACEMENTS:
            raise ValueError(f"{t.__name__} already has a replacement")

    def deco(fn: Replacement) -> Replacement:
        for t in types:
            _REPLACEMENTS[t] = fn
        return fn

    return deco


def replacement(module: nn.Module) -> nn.Module | None:
    """The module to take the place of sliced ``module``, or None to keep it."""
    fn = _REPLACEMENTS.get(type(module))
    return fn(module) if fn is not None else None


def has_shrink_rule(module: nn.Module) -> bool:
    """Whether ``module``'s class, or one of its bases, has a shrink rule."""
    return _rule_for(module) is not None


# ------------------------------------------------------------------ helpers
def _rule_for(module: nn.Module) -> ShrinkRule | None:
    table = dict(_RULES)
    for name, fn in _NAMED.items():
        cls = _resolve(name)
        if cls is not None:
            table.setdefault(cls, fn)
    for t in type(module).__mro__:
        if t in table:
            return table[t]
    return None


def _resolve(name: str) -> type | None:
    """The class ``"package.module.Class"`` names, if ``package.module`` is loaded; never
    imports anything."""
    module_name, _, cls_name = name.rpartition(".")
    found = getattr(sys.modules.get(module_name), cls_name, None)
    return found if isinstance(found, type) else None


def _check_key(key: object) -> None:
    if isinstance(key, str):
        if "." not in key or not all(p.isidentifier() for p in key.split(".")):
            raise ValueError(
                f"shrink rule key {key!r}: expected a class or a qualified class name such "
                "as 'package.module.Class'"
            )
    elif not isinstance(key, type):
        raise TypeError(f"a shrink rule key is a class or 'package.module.Class', got {key!r}")


def _same_class_registered(key: ShrinkKey) -> bool:
    """Whether the class ``key`` stands for already has a rule under another key."""
    if isinstance(key, str):
        cls = _resolve(key)
        return cls is not None and cls in _RULES
    return any(_resolve(name) is key for name in _NAMED)


def _key_name(key: ShrinkKey) -> str:
    return key if isinstance(key, str) else key.__name__


@register_shrink_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def _conv(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    cout_old = old.get("weight", m.weight.shape)[0]
    per_group_out = cout_old // m.groups
    new_groups = m.weight.shape[0] // per_group_out if m.groups > 1 else 1
    m.groups = new_groups
    m.out_channels = m.weight.shape[0]
    m.in_channels = m.weight.shape[1] * new_groups


@register_shrink_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
def _conv_t(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    m.in_channels = m.weight.shape[0]
    m.out_channels = m.weight.shape[1] * m.groups


@register_shrink_rule(nn.Linear)
def _linear(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    m.out_features, m.in_features = m.weight.shape


@register_shrink_rule(nn.RNNBase)
def _recurrent(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    """A recurrent layer's input width (its first layer's input weights' columns) and hidden
    units (one count for every layer and direction: the recurrent weights' columns, an LSTM's
    projected units where it has ``proj_size``, and then its cells, the projection's columns);
    the module's list of its weights is read again (the parameters are new)."""
    m.input_size = m.weight_ih_l0.shape[1]
    if m.proj_size:
        if m.weight_hr_l0.shape[0] != m.weight_hh_l0.shape[1]:
            raise ValueError(
                f"{type(m).__name__}: the projection makes {m.weight_hr_l0.shape[0]} units and "
                f"the recurrent weights read {m.weight_hh_l0.shape[1]}: a plan that keeps "
                "different projected units in them cannot shrink the layer"
            )
        m.proj_size = m.weight_hh_l0.shape[1]
        m.hidden_size = m.weight_hr_l0.shape[1]  # (its cells)
        if m.proj_size >= m.hidden_size:
            raise ValueError(
                f"{type(m).__name__}: {m.proj_size} projected units would be kept for "
                f"{m.hidden_size} cells; PyTorch runs an LSTM only with fewer projected units "
                "than cells: keep more cells"
            )
    else:
        m.hidden_size = m.weight_hh_l0.shape[1]
    m._init_flat_weights()


@register_shrink_rule(nn.Bilinear)
def _bilinear(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    m.out_features, m.in1_features, m.in2_features = m.weight.shape


@register_shrink_rule(
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
def _batch_norm(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    t = m.weight if m.weight is not None else m.running_mean
    if t is not None:
        m.num_features = t.shape[0]


@register_shrink_rule(nn.GroupNorm)
def _group_norm(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    if m.weight is None:
        return
    per_group = old.get("weight", m.weight.shape)[0] // m.num_groups
    m.num_channels = m.weight.shape[0]
    m.num_groups = m.num_channels // per_group


@register_shrink_rule(nn.LayerNorm)
def _layer_norm(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    if m.weight is not None:
        m.normalized_shape = tuple(m.weight.shape)


@register_shrink_rule(nn.Embedding)
def _embedding(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    m.num_embeddings, m.embedding_dim = m.weight.shape


@register_shrink_rule(nn.PReLU)
def _prelu(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    m.num_parameters = m.weight.shape[0]


@register_shrink_rule("transformers.pytorch_utils.Conv1D")
def _hf_conv1d(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    """Hugging Face's ``Conv1D`` (GPT-2, GPT): a Linear whose weight is stored transposed,
    (in, out) = (nx, nf); its forward shapes the output by ``nf``."""
    m.nx, m.nf = m.weight.shape
