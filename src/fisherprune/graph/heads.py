"""Attention heads: which module attributes hold a head count, and modules whose heads cannot
be removed on their own.

When the reshape rule meets a width split into blocks (heads), it asks ``head_attributes``
about the module making the split. The split makes each head one prunable channel only if the
shrunk module can still make it: its head count is inferred (``view(..., -1, head_dim)``, as
Hugging Face writes it) or held in an attribute that ``shrink`` then sets to the heads kept.
Otherwise (a channel shuffle's fixed group count, a head count written as a constant, a module
type registered with ``register_fixed_heads``) the split's channels are blocked, with the
reason.
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "GROUP_SIZE_ATTRIBUTES",
    "HEADS_WIDTH_ATTRIBUTES",
    "HEAD_COUNT_ATTRIBUTES",
    "WIDTH_ATTRIBUTES",
    "group_size_attributes",
    "head_attributes",
    "register_fixed_heads",
    "width_attributes",
]

#: attribute names that hold a head count (of query or of key/value heads), in the spellings of
#: PyTorch, Hugging Face, nanoGPT and timm
HEAD_COUNT_ATTRIBUTES: tuple[str, ...] = (
    "num_heads",
    "n_heads",
    "n_head",
    "heads",
    "nheads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
)
#: attribute names that hold how many query heads read each key/value head (grouped-query
#: attention; Hugging Face's ``num_key_value_groups``, which its ``repeat_kv`` repeats by)
GROUP_SIZE_ATTRIBUTES: tuple[str, ...] = (
    "num_key_value_groups",
    "num_queries_per_kv",
    "num_kv_groups",
    "n_rep",
)
#: attribute names that hold the width of all heads together (heads x head_dim)
HEADS_WIDTH_ATTRIBUTES: tuple[str, ...] = ("all_head_size", "split_size", "inner_dim", "output_dim")
#: attribute names that hold a channel width (the hidden width, as torchvision's ViT writes
#: ``x.reshape(n, self.hidden_dim, n_h * n_w)``)
WIDTH_ATTRIBUTES: tuple[str, ...] = (
    "hidden_dim",
    "hidden_size",
    "embed_dim",
    "d_model",
    "n_embd",
    "width",
)
_FIXED: dict[type, str] = {}


def register_fixed_heads(*types: type, reason: str) -> None:
    """Declare that modules of these types cannot lose heads on their own (their heads are
    then reported as not prunable, for ``reason``).

    Raises:
        ValueError: a type is already registered.
    """
    for t in types:
        if t in _FIXED:
            raise ValueError(f"{t.__name__} is already registered as keeping its heads")
        _FIXED[t] = reason


def head_attributes(
    module: nn.Module | None, count: int, head_dim: int, inferred: bool
) -> tuple[str, ...] | str:
    """Whether ``module`` can lose some of the ``count`` heads of ``head_dim`` channels it
    splits a width into: the names of its attributes that hold that count (possibly none, when
    ``inferred``: the code asked for -1 heads), and of those that hold ``count * head_dim``
    (``all_head_size``, GPT-2's ``split_size``); or, if it cannot, the reason (its type is
    registered with ``register_fixed_heads``, or the count is written into its code)."""
    if module is not None:
        fixed = next((_FIXED[t] for t in type(module).__mro__ if t in _FIXED), None)
        if fixed is not None:
            return fixed
    names = _int_attributes(module, HEAD_COUNT_ATTRIBUTES, count)
    if names or inferred:
        return names + _int_attributes(module, HEADS_WIDTH_ATTRIBUTES, count * head_dim)
    return (
        f"splits channels into {count} blocks (heads, or a channel shuffle) whose count is "
        f"written into the code: neither -1 nor an attribute such as "
        f"{', '.join(HEAD_COUNT_ATTRIBUTES[:3])} that shrink could update"
    )


def group_size_attributes(module: nn.Module | None, size: int) -> tuple[str, ...]:
    """The attributes of ``module`` named in ``GROUP_SIZE_ATTRIBUTES`` that hold ``size``, the
    query heads per key/value head: where query heads are pruned by slot, ``shrink`` sets them
    to the slots kept."""
    return _int_attributes(module, GROUP_SIZE_ATTRIBUTES, size)


def width_attributes(module: nn.Module | None, width: int) -> tuple[str, ...]:
    """The attributes of ``module`` named in ``WIDTH_ATTRIBUTES`` that hold ``width``: where a
    reshape writes a channel width as a number, ``shrink`` sets them to the channels kept."""
    return _int_attributes(module, WIDTH_ATTRIBUTES, width)


def sizes_attributes(module: nn.Module | None, sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The public attribute of ``module`` that holds ``sizes`` as a plain list or tuple of
    integers (timm's ``MixedConv2d.splits``), as a 1-tuple: where a split's sizes are read
    from it, ``shrink`` sets it to the channels each piece keeps. None (``()``) when no
    attribute or several hold them (which one the code read cannot be told)."""
    if module is None:
        return ()
    found = tuple(
        a
        for a, v in vars(module).items()
        if not a.startswith("_")
        and type(v) in (list, tuple)
        and all(type(e) is int for e in v)
        and tuple(v) == sizes
    )
    return found if len(found) == 1 else ()


def _int_attributes(
    module: nn.Module | None, names: tuple[str, ...], value: int
) -> tuple[str, ...]:
    """Those of ``names`` that are integer attributes of ``module`` equal to ``value``."""
    return tuple(
        a
        for a in names
        if isinstance(getattr(module, a, None), int)
        and not isinstance(getattr(module, a), bool)
        and getattr(module, a) == value
    )
