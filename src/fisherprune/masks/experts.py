"""Expert gates: the experts of a mixture-of-experts layer as prunable units.

A mixture-of-experts (MoE) layer has a router and a set of experts whose weights are stacked
along a leading dim of ``num_experts`` (Hugging Face Qwen2/Qwen3-MoE, Mixtral, OLMoE): the
router's logits ``F.linear(hidden, router.weight)`` (one row per expert) pick each token's
``top_k`` experts and their routing weights. ``ExpertGate`` is one mask over one layer's
experts. Entry ``e`` at 0 means expert ``e`` is gone, as in the shrunk model, where its router
row and its weights are sliced off:

- **forward.** While the router runs, its logits get ``-inf`` at every removed expert
  (``ExpertGatePoint``), so top-k never picks it and a softmax normalises over the kept
  experts only: the routing of the shrunk model, which has no such logit.
- **signal.** A multiplicative gate ``g_e`` on expert ``e``'s routing weights (the scores the
  router returns, after any top-k normalisation): the per-example derivative of the loss with
  respect to ``g_e`` is ``sum over the example's tokens t and slots j routed to e of
  w[t, j] * dL/dw[t, j]`` (the router's rows are the tokens of ``N`` examples flattened in
  order), gathered in the backward that training runs and squared per example like every
  channel's: ``1/2 mean_n g[n, e]^2``. It estimates the loss change if ``e``'s contribution
  vanished (without re-routing its tokens).
- **floor.** A layer keeps at least ``top_k`` experts (``min_kept``).

Refused, with the reason, at ``install_expert_gates``: a router that holds tensors besides its
weight (DeepSeek-V3's ``e_score_correction_bias``: biased, group-limited sigmoid routing is not
"never route to the removed expert"), a router whose logits are not ``F.linear`` of its weight,
and rows that are not the layer input's tokens flattened in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from fisherprune.inputs import Inputs
from fisherprune.masks import tracing
from fisherprune.masks.compiled import compiling
from fisherprune.masks.layer import MaskLayer, gathering_enabled
from fisherprune.modes import eval_mode

__all__ = ["ExpertGate", "ExpertGatePoint", "MoELayer", "find_moe_layers", "install_expert_gates"]

#: the key suffix of an expert gate in the ``fisherprune_masks`` holder
GATE_SUFFIX = ":experts"
#: the module attributes that count a layer's experts (set on the router, the experts module
#: and the layer when experts are removed)
COUNT_ATTRIBUTES = ("num_experts", "num_local_experts")


@dataclass(frozen=True)
class MoELayer:
    """Where one mixture-of-experts layer's parts are, by qualified module name.

    Attributes:
        layer: the module that holds the router and the experts.
        router: its router: ``weight`` (num_experts, hidden), returns top-k weights and ids.
        experts: its experts module: every parameter of leading dim ``num_experts``.
        num_experts: experts in the layer.
        top_k: experts each token is routed to.
    """

    layer: str
    router: str
    experts: str
    num_experts: int
    top_k: int

    def tensor_names(self, model: nn.Module) -> list[str]:
        """Qualified names of the tensors with one entry per expert along dim 0: the router's
        weight and every parameter of the experts module."""
        params = model.get_submodule(self.experts).named_parameters()
        return [f"{self.router}.weight", *(f"{self.experts}.{n}" for n, _ in params)]


class ExpertGate(MaskLayer):
    """A mask over one MoE layer's experts: entry ``e`` is expert ``e``'s gate.

    Buffers as ``MaskLayer`` (``mask``: ones, ``signal``: zeros, one entry per expert). It is
    not applied to a tensor of its own: ``ExpertGatePoint`` hooks on the router apply it.

    Args:
        moe: the layer it gates.
        tensor_names: the tensors that lose an expert's entry along dim 0 (``MoELayer``).

    Raises:
        ValueError: fewer than 2 experts.
    """

    def __init__(self, moe: MoELayer, tensor_names: list[str]) -> None:
        super().__init__(moe.num_experts, dim=1)
        #: qualified names of the layer, its router and its experts module
        self.layer_path, self.router_path, self.experts_path = moe.layer, moe.router, moe.experts
        #: tensors with one entry per expert along dim 0 (sliced when experts go)
        self.tensor_names = list(tensor_names)
        #: the fewest experts ``prune`` may leave: each token needs ``top_k`` of them
        self.min_kept = moe.top_k

    def extra_repr(self) -> str:
        return f"layer={self.layer_path!r}, top_k={self.min_kept}, {super().extra_repr()}"


class _LogitMask(TorchFunctionMode):
    """While active: adds ``bias`` to the output of ``F.linear(x, weight)`` and counts how
    often that ran (``bias`` None: only counts)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias, self.hits = weight, bias, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if func is F.linear and len(args) > 1 and args[1] is self.weight:
            self.hits += 1
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out


class _RoutingGate(torch.autograd.Function):
    """The router's top-k weights, unchanged; the backward hands ``gate`` each example's
    derivative of the loss with respect to a multiplicative gate per expert on them."""

    @staticmethod
    def forward(ctx, weights, ids, gate, batch):  # type: ignore[override]
        ctx.save_for_backward(weights, ids)
        ctx.gate, ctx.batch = gate, batch
        return weights.detach()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        weights, ids = ctx.saved_tensors
        n, gate = ctx.batch, ctx.gate
        g = grad.detach() if grad.requires_grad else grad
        acc = torch.float32 if weights.dtype in (torch.float16, torch.bfloat16) else weights.dtype
        contrib = (g * weights).to(acc).reshape(n, -1)  # (N, tokens x top_k)
        per = contrib.new_zeros(n, gate.num_channels)
        per.scatter_add_(1, ids.reshape(n, -1).to(per.device), contrib)  # (N, experts)
        gate.accumulate(per, None)
        return grad, None, None, None


def _first_tensor(args: tuple, kwargs: dict[str, Any]) -> Tensor | None:
    """A module's first tensor argument (positional, then keyword): a layer's hidden state."""
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)


def _routing(out: Any) -> tuple[int, int] | None:
    """Positions of the top-k weights (float) and ids (integer, same 2-D shape) in a router's
    output tuple (the last such pair), or None."""
    if not isinstance(out, (tuple, list)):
        return None
    tensors = [(i, t) for i, t in enumerate(out) if isinstance(t, Tensor) and t.dim() == 2]
    for i, ids in reversed(tensors):
        if ids.is_floating_point():
            continue
        for j, t in tensors:
            if t.is_floating_point() and t.shape == ids.shape:
                return j, i
    return None


def _logit_bias_of(mask: Tensor) -> Tensor:
    """0 at each kept expert's logit, ``-inf`` at each removed one's (by tensor operations:
    nothing read back)."""
    return torch.zeros_like(mask).masked_fill_(mask < 0.5, -torch.inf)


class ExpertGatePoint:
    """The hooks of one gated MoE layer: a pre-hook on the layer (its batch size), a pre-hook
    and a hook (``always_call``) on the router (the ``-inf`` logits of removed experts, the
    signal's gate on the routing weights).

    Changes nothing while a tracer runs (the trace sees the dense router; the cost model
    prices removed experts from their tensors' shapes).
    """

    def __init__(self, gate: ExpertGate, router: nn.Module) -> None:
        self.gate = gate
        self.weight = router.weight
        self.batch = 0
        self._mode: _LogitMask | None = None
        #: (the mask, its version, 0 or -inf per expert)
        self._bias: tuple[Tensor, int, Tensor] | None = None

    def layer_pre(self, _m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = _first_tensor(args, kwargs)
        self.batch = int(x.shape[0]) if x is not None and x.dim() >= 3 else 0

    def router_pre(self, _m: nn.Module, _args: tuple) -> None:
        if tracing.active() is not None:
            return
        if compiling():  # in a graph: from the mask's values at every call, nothing read back
            bias = _logit_bias_of(self.gate.mask)
        elif self.gate.is_all_ones():
            return
        else:
            bias = self._logit_bias()
        self._mode = _LogitMask(self.weight, bias)
        self._mode.__enter__()

    def _logit_bias(self) -> Tensor:
        """0 at each kept expert's logit, ``-inf`` at each removed one's (made again only when
        the mask changed)."""
        mask, cached = self.gate.mask, self._bias
        if cached is None or cached[0] is not mask or cached[1] != mask._version:
            cached = self._bias = (mask, mask._version, _logit_bias_of(mask))
        return cached[2]

    def router_post(self, _m: nn.Module, _args: tuple, out: Any) -> Any:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            if mode.hits != 1:
                raise ValueError(
                    f"the router {self.gate.router_path} ran F.linear with its weight "
                    f"{mode.hits} times in one call (1 expected): its removed experts' "
                    "logits cannot be masked"
                )
        gate = self.gate
        if tracing.active() is not None or not (gate.collecting and gathering_enabled()):
            return None
        at = _routing(out)
        if at is None or self.batch < 1 or out[at[1]].shape[0] % self.batch:
            raise ValueError(
                f"the router {gate.router_path} returned no top-k weights and ids whose rows "
                "are the layer input's tokens: its experts' signal cannot be gathered"
            )
        gate.start_pass()
        w, ids = out[at[0]], out[at[1]]
        gated = _RoutingGate.apply(w, ids, gate, self.batch)
        return type(out)(gated if i == at[0] else t for i, t in enumerate(out))


def _candidates(model: nn.Module) -> Iterator[tuple[str, str, str, int]]:
    """(layer, router, experts, num_experts) for every module with a child whose 2-D
    ``weight`` has one row per expert of a sibling whose parameters all lead with that count."""
    for name, mod in model.named_modules():
        kids = dict(mod.named_children())
        for rname, r in kids.items():
            w = getattr(r, "weight", None)
            if not isinstance(w, Tensor) or w.dim() != 2 or w.shape[0] < 2:
                continue
            e = int(w.shape[0])
            for xname, x in kids.items():
                ps = list(x.parameters())
                if x is not r and ps and all(p.dim() == 3 and p.shape[0] == e for p in ps):
                    pre = f"{name}." if name else ""
                    yield name, pre + rname, pre + xname, e


def _refusal(model: nn.Module, router: str) -> str | None:
    """Why the router's experts cannot be gated by masking its logits, or None."""
    r = model.get_submodule(router)
    extra = [n for n, _ in [*r.named_parameters(), *r.named_buffers()] if n != "weight"]
    if extra:
        return (
            f"the router {router} holds {', '.join(extra)} besides its weight (as "
            "DeepSeek-V3's biased, group-limited routing does): removing an expert there is "
            "not the same as never routing to it"
        )
    return None


def find_moe_layers(model: nn.Module, example_inputs: Any) -> list[MoELayer]:
    """The model's mixture-of-experts layers, checked by one forward pass (eval mode, no
    grad; the model is left as it was): each router's logits are ``F.linear`` of its weight
    once per call, and it returns top-k weights and ids with one row per token of the layer's
    (N, positions, hidden) input.

    Raises:
        ValueError: no MoE layer, or one that cannot be gated (the message says why).
    """
    found = list(_candidates(model))
    if not found:
        raise ValueError(
            "experts=True: the model has no mixture-of-experts layer (a router whose weight "
            "has one row per expert next to experts whose parameters lead with that count)"
        )
    for _layer, router, _x, _e in found:
        why = _refusal(model, router)
        if why:
            raise ValueError(f"experts=True: {why}")
    probes = {router: _Probe(model.get_submodule(router).weight) for _l, router, _x, _e in found}
    handles: list[RemovableHandle] = []
    for layer, router, _x, _e in found:
        probe, r = probes[router], model.get_submodule(router)
        handles += [
            model.get_submodule(layer).register_forward_pre_hook(probe.layer_pre, with_kwargs=True),
            r.register_forward_pre_hook(probe.router_pre),
            r.register_forward_hook(probe.router_post, always_call=True),
        ]
    try:
        with eval_mode(model), torch.no_grad():
            Inputs.of(example_inputs).call(model)
    finally:
        for h in handles:
            h.remove()
    return [probes[router].checked(layer, router, x, e) for layer, router, x, e in found]


class _Probe:
    """What one example forward pass shows of a candidate layer: the shapes of its inputs and,
    per router call, how often ``F.linear`` read the router's weight and what it returned."""

    def __init__(self, weight: Tensor) -> None:
        self.mode = _LogitMask(weight, None)
        self.shapes: list[torch.Size | None] = []
        self.calls: list[tuple[int, Any]] = []

    def layer_pre(self, _m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = _first_tensor(args, kwargs)
        self.shapes.append(None if x is None else x.shape)

    def router_pre(self, _m: nn.Module, _args: tuple) -> None:
        self.mode.hits = 0
        self.mode.__enter__()

    def router_post(self, _m: nn.Module, _args: tuple, out: Any) -> None:
        self.mode.__exit__(None, None, None)
        self.calls.append((self.mode.hits, out))

    def checked(self, layer: str, router: str, experts: str, e: int) -> MoELayer:
        """The ``MoELayer`` seen, or ValueError saying what is off."""
        shape = self.shapes[0] if len(self.shapes) == 1 else None
        if shape is None or len(shape) < 3 or len(self.calls) != 1:
            raise ValueError(
                f"experts=True: the MoE layer {layer} did not run once, with its router once, "
                "on an (N, positions, hidden) input in the example forward pass"
            )
        hits, out = self.calls[0]
        if hits != 1:
            raise ValueError(
                f"experts=True: the router {router} computed its logits as F.linear of its "
                f"weight {hits} times (1 expected): its removed experts' logits cannot be masked"
            )
        at = _routing(out)
        if at is None or out[at[1]].shape[0] != shape[:-1].numel() or out[at[1]].shape[1] >= e:
            raise ValueError(
                f"experts=True: the router {router} does not return top-k weights and expert "
                "ids with one row per token of its layer's input"
            )
        return MoELayer(layer, router, experts, e, int(out[at[1]].shape[1]))


def install_expert_gates(
    model: nn.Module, layers: list[MoELayer]
) -> tuple[list[ExpertGate], list[RemovableHandle]]:
    """Hook a new ``ExpertGate`` on each MoE layer of ``layers`` (``find_moe_layers``).

    Changes: a forward pre-hook on each MoE layer and a forward pre-hook and hook on its
    router (the returned handles remove them). The gates are returned, not attached: the
    caller holds them (``apply_masks`` puts them in its ``fisherprune_masks`` holder).
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    gates, handles = [], []
    for moe in layers:
        gate = ExpertGate(moe, moe.tensor_names(model)).to(device)
        router = model.get_submodule(moe.router)
        point = ExpertGatePoint(gate, router)
        handles += [
            model.get_submodule(moe.layer).register_forward_pre_hook(
                point.layer_pre, with_kwargs=True
            ),
            router.register_forward_pre_hook(point.router_pre),
            router.register_forward_hook(point.router_post, always_call=True),
        ]
        gates.append(gate)
    return gates, handles
