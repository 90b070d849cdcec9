"""How example inputs and batches are handed to a model, and where their batch is.

Every function of this package that runs a model on example inputs (``apply_masks``,
``computational_cost`` / ``CostModel``, ``shrink``, ``PruningPlan.from_model``,
``export_model``, ``measure_latency``, ``frozen_for_serving``, ``PruningOptimizer``) reads
them through ``Inputs``, so the convention below holds in all of them.

What an ``example_inputs`` value stands for:

* a ``dict`` (any ``Mapping`` with string keys, e.g. a tokenizer's ``BatchEncoding``): the
  model's keyword arguments, ``model(**inputs)``, as Hugging Face models take them;
* a ``tuple`` or ``list``: the model's positional arguments, ``model(*inputs)``;
* anything else (one tensor): the model's one positional argument, ``model(inputs)``.

Values that are not tensors (None, bools, ints, strings) are passed on unchanged. To pass one
list as the only positional argument (a detection model's list of images), wrap it in a tuple:
``([img0, img1],)``.

The batch (what per-example costs are divided by) is read from the arguments, positional ones
in order, then keyword ones in the dict's order; the first argument that has a batch sets it:

* a tensor with at least one dimension: a batch of its dim 0;
* a non-empty ``list`` or ``tuple`` whose items are all tensors: a batch of its length, one
  example per item (a list of images of shape (C, H, W) is a batch of ``len(list)``, not of C);
* any other value that holds tensors (a dict, a nested structure): a batch of the dim 0 of its
  first tensor of at least one dimension;
* anything else (None, numbers, 0-d tensors): no batch.

A batch of 1 broadcasts: where the first argument with a batch has 1 and a later one of the
same shape past dim 0 has more (``position_ids`` of shape (1, L) passed before ``input_ids`` of
shape (N, L)), the first such later argument sets it; a later tensor of another shape (a
lookup table beside a single image) does not.

A tensor is *batch data* when its dim 0 is that size (a list of tensors, when its length is);
other tensors (a lookup table, a mask shared by all examples) are constants of the call: they
are kept whole in the batch-of-one copy that ``apply_masks`` remembers and are not resized
when an export makes its batch dimension dynamic.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from fisherprune.modes import eval_mode

__all__ = ["Inputs", "as_pair", "batch_size", "calibration_pairs", "call_model", "eval_outputs"]

#: how an ``example_inputs`` value was given, so that ``Inputs.value`` gives the same form back
_FORMS = ("one", "tuple", "list", "dict")


@dataclass(frozen=True)
class Inputs:
    """A model's example inputs as positional and keyword arguments (one of them empty).

    Build one with ``Inputs.of(example_inputs)``; see the module docstring for the convention.

    Attributes:
        args: the positional arguments (empty for keyword inputs).
        kwargs: the keyword arguments, in the order given (empty for positional inputs).
        form: how they were given, so that ``value()`` gives that form back: ``"one"`` (a
            single tensor or other value), ``"tuple"``, ``"list"`` or ``"dict"``.

    Raises:
        ValueError: an unknown ``form``, or arguments that do not fit it (keyword arguments
            with a positional form or the reverse, ``"one"`` with other than one argument).
    """

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    form: str = "tuple"

    def __post_init__(self) -> None:
        if self.form not in _FORMS:
            raise ValueError(f"form must be one of {', '.join(_FORMS)}, got {self.form!r}")
        if (self.args if self.form == "dict" else self.kwargs) or (
            self.form == "one" and len(self.args) != 1
        ):
            raise ValueError(
                f"form {self.form!r} does not fit {len(self.args)} positional and "
                f"{len(self.kwargs)} keyword argument(s)"
            )

    @classmethod
    def of(cls, example_inputs: Any) -> Inputs:
        """The arguments ``example_inputs`` stands for (an ``Inputs`` is returned as it is).

        Raises:
            TypeError: a mapping with a key that is not a string.
        """
        if isinstance(example_inputs, Inputs):
            return example_inputs
        if isinstance(example_inputs, Mapping):
            bad = [k for k in example_inputs if not isinstance(k, str)]
            if bad:
                raise TypeError(
                    "a dict of example inputs holds keyword arguments, so its keys must be "
                    f"strings; got {bad[0]!r}"
                )
            return cls((), dict(example_inputs), "dict")
        if isinstance(example_inputs, tuple):
            return cls(example_inputs, {}, "tuple")
        if isinstance(example_inputs, list):
            return cls(tuple(example_inputs), {}, "list")
        return cls((example_inputs,), {}, "one")

    @property
    def keyword(self) -> bool:
        """Whether these are keyword arguments (given as a dict)."""
        return self.form == "dict"

    def value(self) -> Any:
        """The inputs in the form they were given: a tensor, tuple, list or dict."""
        if self.form == "dict":
            return dict(self.kwargs)
        if self.form == "list":
            return list(self.args)
        if self.form == "one":
            return self.args[0]
        return self.args

    def packed(self) -> tuple[Any, ...] | dict[str, Any]:
        """The arguments as one value: the dict of keyword arguments for keyword inputs, else
        the tuple of positional ones (the shape of ``torch.export``'s ``dynamic_shapes``)."""
        return dict(self.kwargs) if self.keyword else self.args

    def call(self, model: Callable[..., Any]) -> Any:
        """``model(*args, **kwargs)``: what ``model`` returns for these inputs.

        Raises:
            TypeError: keyword inputs (a dict) that ``model``'s forward does not take: it names
                the forward's inputs and the dict's keys and says what to pass instead. Any
                other error of the call is raised as it is.
        """
        try:
            return model(*self.args, **self.kwargs)
        except TypeError as e:
            refused = _refused_keywords(model, self.kwargs) if self.keyword else None
            if refused is None:
                raise
            raise TypeError(refused) from e

    def arguments(self) -> list[tuple[str, Any]]:
        """``(name, value)`` of every argument in order: positional ones named by their index
        (``"0"``, ``"1"``, ...), keyword ones by their key."""
        return [(str(i), a) for i, a in enumerate(self.args)] + list(self.kwargs.items())

    def map(self, fn: Callable[[Any], Any]) -> Inputs:
        """New inputs of the same form with ``fn`` applied to each argument."""
        return Inputs(
            tuple(fn(a) for a in self.args),
            {k: fn(v) for k, v in self.kwargs.items()},
            self.form,
        )

    # ------------------------------------------------------------------ batch
    @property
    def batch_size(self) -> int:
        """The number of examples (see the module docstring for the rule).

        Raises:
            ValueError: no argument has a batch (no tensor of at least one dimension).
        """
        found = []  # (a loop: dynamo breaks the graph on a walrus inside a comprehension)
        for _, a in self.arguments():
            n = _argument_batch(a)
            if n is not None:
                found.append((n, a))
        if found:
            first, arg = found[0]
            if first != 1:
                return first
            rest = _first_tensor(arg)
            return next((n for n, a in found[1:] if n > 1 and _broadcasts(rest, a)), 1)
        raise ValueError(
            "example_inputs must hold at least one tensor with a batch dimension (dim 0), or "
            "a list of tensors (one per example)"
        )

    def tensors(self) -> list[tuple[Tensor, bool]]:
        """Every tensor of the inputs in order (positional arguments, then keyword ones; pytree
        order inside each), with whether its dim 0 is the batch (False for the items of a
        list of examples, whose dim 0 is their own).

        Raises:
            ValueError: no argument has a batch.
        """
        n = self.batch_size
        found: list[tuple[Tensor, bool]] = []
        for _, a in self.arguments():
            in_list = _tensor_list(a)
            leaves = tree_flatten(a)[0]
            found += [(t, not in_list and _batched(t, n)) for t in leaves if isinstance(t, Tensor)]
        return found

    def map_leaves(self, fn: Callable[[Any, bool], Any]) -> Inputs:
        """New inputs of the same structure with every leaf ``x`` (tensor or not, the items of
        lists of examples too) replaced by ``fn(x, batched)``, where ``batched`` says whether
        ``x`` is a tensor whose dim 0 is the batch.

        Raises:
            ValueError: no argument has a batch.
        """
        n = self.batch_size

        def arg(a: Any) -> Any:
            in_list = _tensor_list(a)
            return tree_map(lambda x: fn(x, not in_list and _batched(x, n)), a)

        return self.map(arg)

    def batch_of_one(self) -> Inputs:
        """Detached copies of the first example: batch tensors cut to their first row, a list
        of examples to its first item; other tensors copied whole, other values as they are.

        Raises:
            ValueError: no argument has a batch.
        """
        n = self.batch_size

        def arg(a: Any) -> Any:
            if _tensor_list(a):
                return type(a)(t.detach().clone() for t in (a[:1] if len(a) == n else a))
            return tree_map(lambda x: _copy(x[:1] if _batched(x, n) else x), a)

        return self.map(arg)

    def repeated(self, times: int) -> Inputs:
        """The batch ``times`` over: every batch tensor concatenated with itself along dim 0.
        Lists of examples and other tensors are left as they are (an exported graph fixes a
        list's length).

        Raises:
            ValueError: no argument has a batch.
        """
        return self.map_leaves(lambda x, b: torch.cat([x] * times) if b else x)


def _batched(x: Any, n: int) -> bool:
    """Whether ``x`` is a tensor whose dim 0 is a batch of ``n``."""
    return isinstance(x, Tensor) and x.dim() > 0 and int(x.shape[0]) == n


def _copy(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, Tensor) else x


def _tensor_list(a: Any) -> bool:
    """A non-empty plain list or tuple whose items are all tensors: a list of examples."""
    return type(a) in (list, tuple) and len(a) > 0 and all(isinstance(t, Tensor) for t in a)


def _first_tensor(a: Any) -> Tensor | None:
    """The first tensor of at least one dimension in an argument, or None."""
    return next((t for t in tree_flatten(a)[0] if isinstance(t, Tensor) and t.dim() > 0), None)


def _broadcasts(one: Tensor | None, a: Any) -> bool:
    """Whether ``one`` (a batch of 1) has the shape of ``a``'s first tensor past dim 0: a
    ``position_ids`` (1, L) beside ``input_ids`` (N, L), not a lookup table of other shape."""
    other = _first_tensor(a)
    return one is not None and other is not None and one.shape[1:] == other.shape[1:]


def _argument_batch(a: Any) -> int | None:
    """The batch one argument stands for, or None (see the module docstring)."""
    if isinstance(a, Tensor):
        return int(a.shape[0]) if a.dim() > 0 else None
    if _tensor_list(a):
        return len(a)
    for t in tree_flatten(a)[0]:
        if isinstance(t, Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def _refused_keywords(model: Callable[..., Any], kwargs: dict[str, Any]) -> str | None:
    """Why ``model``'s forward cannot take ``kwargs`` as keyword arguments; None when its
    signature takes them (an error of the call came from inside it) or cannot be read. Read
    only once a call has failed, so that calls that work pay nothing for it."""
    forward = model.forward if isinstance(model, nn.Module) else model
    try:
        sig = inspect.signature(forward)
        sig.bind(**kwargs)
    except ValueError:  # no signature (a builtin)
        return None
    except TypeError as e:
        params = sig.parameters.values()
        names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        return (
            f"{getattr(forward, '__qualname__', 'the model')} takes "
            f"{', '.join(names) or 'no named inputs'}, not the keys {list(kwargs)} of the dict "
            f"of example inputs ({e}): a dict is passed as keyword arguments, model(**inputs); "
            "pass the tensor itself for one positional input, a tuple of the positional inputs "
            "in order, or a dict keyed by the forward's argument names"
        )
    return None


def call_model(model: Callable[..., Any], example_inputs: Any) -> Any:
    """``model`` called on ``example_inputs`` by the convention of this module: ``model(x)``,
    ``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a dict."""
    return Inputs.of(example_inputs).call(model)


def batch_size(example_inputs: Any) -> int:
    """The number of examples in ``example_inputs`` (the rule is in the module docstring).

    Raises:
        ValueError: no argument has a batch.
    """
    return Inputs.of(example_inputs).batch_size


def as_pair(batch: Any) -> tuple[Any, Any]:
    """A data batch as ``(inputs, targets)``: a pair as it is; a mapping (a Hugging Face
    batch, ``labels`` among its keys or not) as ``(batch, None)``: the model gets every key as
    a keyword, so a loss can read the model's own (``loss_fn=lambda out, _: out.loss``).

    Raises:
        ValueError: anything else; it says what came.
    """
    if isinstance(batch, Mapping):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    what = f"a {type(batch).__name__}" + (
        f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    )
    raise ValueError(
        f"a data batch must be an (inputs, targets) pair or a dict of the model's keyword "
        f"inputs (a Hugging Face batch), got {what}; yield (inputs, None) when there are no "
        "targets"
    )


class _PairView:
    """A re-iterable of batches seen as ``(inputs, targets)`` pairs (``as_pair``)."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return (as_pair(b) for b in self.batches)

    def __len__(self) -> int:
        """The number of batches (a progress bar's total); TypeError where it is unknown."""
        return len(self.batches)  # type: ignore[arg-type]


def calibration_pairs(batches: Iterable[Any]) -> Iterable[tuple[Any, Any]]:
    """``batches`` as ``(inputs, targets)`` pairs (``as_pair``), iterable once per pass: an
    iterator is read into a list, a re-iterable (a list, a ``DataLoader``) is read again on
    each pass.

    Raises:
        ValueError: a batch of an iterator that is neither a pair nor a mapping.
    """
    if iter(batches) is batches:
        return [as_pair(b) for b in batches]
    return _PairView(batches)


def eval_outputs(model: nn.Module, example_inputs: Any) -> list[Tensor]:
    """Every tensor ``model`` returns for ``example_inputs`` in eval mode without autograd,
    flattened in order and detached copies; the model's train/eval flags are given back."""
    with eval_mode(model), torch.no_grad():
        out = call_model(model, example_inputs)
    return [t.detach().clone() for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
