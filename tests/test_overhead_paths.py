"""The cheap paths of the masks: one reduction per masked tensor however many layers read it,
no host sync inside a training step, nothing kept beyond the step, and per-example gradients
by ``torch.func`` over masks that are not collecting (the baseline ``overhead.py`` times)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import fisherprune as fp
from fisherprune.masks import layer as mask_layer
from fisherprune.masks.points import find_holder
from fisherprune.signals import gather
from tests.zoo import build_transformer_sdpa, token_input

RTOL = 1e-6  # float64 model, float32 mask and signal buffers (apply_masks creates them)


def _masked_transformer() -> tuple[nn.Module, dict[str, fp.MaskLayer]]:
    model = build_transformer_sdpa().double()
    masks = dict(fp.apply_masks(model, token_input(1).double()))
    return model, masks


def _step(model: nn.Module, x: Tensor, y: Tensor) -> None:
    F.cross_entropy(model(x), y).backward()


def _reductions_of_a_step(monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> int:
    """How many per-example reductions one training step of ``model`` runs in backward."""
    calls: list[tuple[int, ...]] = []
    reduce = mask_layer._per_example_channel_dot

    def counting(g: Tensor, x: Tensor, dim: int, batch_dim: int = 0) -> Tensor:
        calls.append(tuple(x.shape))
        return reduce(g, x, dim, batch_dim)

    monkeypatch.setattr(mask_layer, "_per_example_channel_dot", counting)
    x, y = token_input(4).double(), torch.arange(4) % 5
    _step(model, x, y)
    return len(calls)


def test_layers_reading_one_tensor_share_one_reduction(monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k and v read the same normalised tensor: the hidden-width mask multiplies it once
    and reduces it once in backward (one call per masked tensor, not per consumer)."""
    model, _ = _masked_transformer()
    calls = _reductions_of_a_step(monkeypatch, model)
    found = find_holder(model)
    assert found is not None
    consumers = sorted(mp.module_name for mp in found[1].points)
    assert consumers == ["attn.k", "attn.out", "attn.q", "attn.v", "head", "mlp.fc1", "mlp.fc2"]
    assert calls == 5  # (q, k, v) once; out, fc1, fc2, head


def test_frozen_layers_reading_one_tensor_share_one_reduction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every weight frozen (``prune_to_target``'s signal passes), no layer saves its input
    for the backward, yet q, k and v still share one product and one reduction in backward."""
    model, _ = _masked_transformer()
    model.requires_grad_(False)
    assert _reductions_of_a_step(monkeypatch, model) == 5  # (q, k, v) once; out, fc1, fc2, head


def test_a_forward_without_backward_leaves_no_product_alive() -> None:
    """A shared product is held only until the model call ends: a forward with gradients
    whose output is dropped without a backward frees the last one made (the head's input) and
    the graph it holds."""
    model, masks = _masked_transformer()
    for m in masks.values():
        m.collecting = True
    seen: list[weakref.ref] = []
    handle = model.get_submodule("head").register_forward_pre_hook(
        lambda mod, args: seen.append(weakref.ref(args[0]))
    )
    out = model(token_input(2).double())
    handle.remove()
    assert seen and seen[0]() is not None  # held by the output's graph
    del out
    gc.collect()
    assert seen[0]() is None


def test_signal_unchanged_by_sharing() -> None:
    """The shared product gives q, k and v's gradients summed, as the chain rule for one mask
    says: the signal equals the float64 per-example loop over d loss_n / d mask."""
    model, masks = _masked_transformer()
    x, y = token_input(3).double(), torch.arange(3) % 5
    _step(model.eval(), x, y)
    fp.update_pruning_signals(masks, decay=0.0)
    for m in masks.values():
        m.collecting = False
    for name, m in masks.items():
        m.mask.requires_grad_(True)
        per_example = []
        for n in range(3):
            loss = F.cross_entropy(model(x[n : n + 1]), y[n : n + 1])
            per_example.append(torch.autograd.grad(loss, m.mask)[0])
        m.mask.requires_grad_(False)
        expected = 0.5 * torch.stack(per_example).pow(2).mean(0)
        assert expected.abs().max() > 0, name  # not vacuous
        torch.testing.assert_close(m.signal, expected, rtol=RTOL, atol=0.0)


def test_torch_func_sees_masks_that_are_not_collecting() -> None:
    """vmap(grad) over an apply_masks model whose masks are finished (not collecting, nothing
    pruned, so their points could fold) still differentiates the masks: it equals the
    in-backward per-example gradients (it once got zeros, the fold path skipping the mask)."""
    model, masks = _masked_transformer()
    model.eval()
    x, y = token_input(3).double(), torch.arange(3) % 5
    _step(model, x, y)
    fp.update_pruning_signals(masks, decay=0.0)
    ours = {k: m.signal.clone() for k, m in masks.items()}
    for m in masks.values():
        m.collecting = False
    keys = {k: f"{k}.mask" for k in masks}
    rest = {
        k: v.detach()
        for k, v in (*model.named_parameters(), *model.named_buffers())
        if k not in keys.values()
    }

    def loss_one(mask_values: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, {**rest, **mask_values}, (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    values = {key: masks[k].mask for k, key in keys.items()}
    g = vmap(grad(loss_one), in_dims=(None, 0, 0))(values, x, y)
    for k, key in keys.items():
        assert ours[k].abs().max() > 0
        torch.testing.assert_close(0.5 * g[key].pow(2).mean(0), ours[k], rtol=RTOL, atol=0.0)


class _NoSync(RuntimeError):
    pass


@pytest.mark.parametrize("state", ["collecting", "finished"])
def test_no_host_sync_inside_the_step(monkeypatch: pytest.MonkeyPatch, state: str) -> None:
    """Forward and backward of a masked model read no tensor value back to the host
    (``.item()``, ``bool()``, ``float()``, ``.tolist()``, ``.cpu()``) once the masks' caches
    are built: with collecting masks, and with pruned ones that fold into the weights after
    an optimizer step moved them."""
    model, masks = _masked_transformer()
    if state == "finished":
        with torch.no_grad():
            for m in masks.values():
                m.mask[: m.num_channels // 2] = 0.0
                m.collecting = False
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = token_input(4).double(), torch.arange(4) % 5
    _step(model, x, y)  # builds the caches (what is all ones, the folded columns)
    opt.step()
    opt.zero_grad()

    def refuse(*args: object, **kwargs: object) -> None:
        raise _NoSync("host sync inside the step")

    for attr in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, attr, refuse)
    _step(model, x, y)  # raises _NoSync on any read-back
    monkeypatch.undo()
    with pytest.raises(_NoSync):  # the patch does catch a read-back
        monkeypatch.setattr(torch.Tensor, "item", refuse)
        x.sum().item()
    monkeypatch.undo()
    if state == "finished":  # the fold happened: pruned columns are zero again
        layer = model.mlp.fc2
        assert layer.weight[:, : layer.in_features // 2].abs().max() == 0


def test_no_host_sync_in_the_signal_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collecting step followed by ``update_pruning_signals`` reads nothing back to the host
    while the skip verdicts are still on their way (as on a GPU, where a read would wait for
    the device); the signals are still updated."""
    model, masks = _masked_transformer()
    x, y = token_input(4).double(), torch.arange(4) % 5
    _step(model, x, y)
    fp.update_pruning_signals(masks, decay=0.5)  # builds the caches
    before = {k: m.signal.clone() for k, m in masks.items()}

    def refuse(*args: object, **kwargs: object) -> None:
        raise _NoSync("host sync inside the step")

    monkeypatch.setattr(gather.PendingFlags, "ready", lambda self: False)
    for attr in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, attr, refuse)
    _step(model, x, y)
    fp.update_pruning_signals(masks, decay=0.5)  # raises _NoSync on any read-back
    monkeypatch.undo()
    assert all(not torch.equal(m.signal, before[k]) for k, m in masks.items())
    fp.update_pruning_signals(masks, decay=0.5)  # reads the verdicts that landed: no warning


def test_nothing_per_example_kept_after_the_step() -> None:
    """After backward and the signal update, no activation-sized tensor (nor the inputs the
    masks multiplied) stays alive through the masks: the shared products are weak."""
    model, masks = _masked_transformer()
    x, y = token_input(4).double(), torch.arange(4) % 5
    hidden = model.embed(x)  # not the masked tensor itself; track what the masks saw instead
    seen: list[weakref.ref[Tensor]] = []
    handle = model.attn.q.register_forward_pre_hook(lambda _m, a: seen.append(weakref.ref(a[0])))
    _step(model, x, y)
    fp.update_pruning_signals(masks, decay=0.5)
    handle.remove()
    del hidden
    gc.collect()
    assert seen and all(r() is None for r in seen)
    assert all(not m.received for m in masks.values())


def test_masked_activations_are_freed_during_the_backward() -> None:
    """A collecting mask with nothing pruned aliases its input; the alias is released once its
    backward ran, so activations are freed as the backward proceeds, as without the mask (it
    once held every masked activation until the whole backward ended: +30% peak on BERT)."""
    model, _ = _masked_transformer()
    x, y = token_input(4).double(), torch.arange(4) % 5
    seen: list[weakref.ref[Tensor]] = []
    handle = model.mlp.fc2.register_forward_pre_hook(  # before the mask's hook: the input
        lambda _m, a: seen.append(weakref.ref(a[0])), prepend=True
    )
    alive_at_embed: list[bool] = []
    model.embed.weight.register_hook(lambda g: alive_at_embed.append(seen[0]() is not None))
    _step(model, x, y)
    handle.remove()
    assert alive_at_embed == [False]
