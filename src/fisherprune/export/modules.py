"""Per-module metadata after slicing: a registry keyed by module type.

After ``PruningPlan.apply`` has sliced a module's parameters and buffers, the
module's rule brings its attributes (``in_channels``, ``num_features``, ``groups``
...) in line with the new shapes. Register a rule for a custom module with::

    @register_shrink_rule(MyLayer)
    def _my_layer(module, old_shapes): module.width = module.weight.shape[0]
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["ShrinkRule", "register_shrink_rule", "unregister_shrink_rule", "update_metadata"]

ShrinkRule = Callable[[nn.Module, dict[str, tuple[int, ...]]], None]
_RULES: dict[type, ShrinkRule] = {}


def register_shrink_rule(*types: type) -> Callable[[ShrinkRule], ShrinkRule]:
    """Register ``fn(module, old_shapes)`` for modules of exactly these types.

    Raises:
        ValueError: a type already has a rule.
    """

    def deco(fn: ShrinkRule) -> ShrinkRule:
        for t in types:
            if t in _RULES:
                raise ValueError(f"{t.__name__} already has a shrink rule")
            _RULES[t] = fn
        return fn

    return deco


def unregister_shrink_rule(*types: type) -> None:
    """Remove the shrink rules of exactly these types (not of their subclasses).

    The inverse of ``register_shrink_rule`` (for a test's cleanup, or to replace a rule,
    built-in ones included: register the new rule afterwards). A module of such a type then
    follows its nearest registered base class's rule, or keeps its attributes as they are.

    Raises:
        ValueError: a type has no rule of its own (then nothing is removed).
    """
    missing = [t for t in types if t not in _RULES]
    if missing:
        raise ValueError(f"{missing[0].__name__} has no shrink rule")
    for t in types:
        del _RULES[t]


def update_metadata(module: nn.Module, old_shapes: dict[str, tuple[int, ...]]) -> None:
    """Apply the rule of ``module``'s type (or its nearest registered base class)."""
    for t in type(module).__mro__:
        rule = _RULES.get(t)
        if rule is not None:
            rule(module, old_shapes)
            return


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
