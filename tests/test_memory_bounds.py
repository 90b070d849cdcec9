"""What ``prune_to_target`` holds in memory beside the model (issue 33, point 1), stated so
that no machine's allocator enters: which tensors are alive (by storage, through ``gc``) when
each layer runs, and whether weights require grad while signals are collected."""

from __future__ import annotations

import copy
import gc
import math
import re
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fisherprune as fp
from fisherprune.allocator import glibc, trim_freed_memory
from fisherprune.calibrate import (
    label_free,
    repair,
    repair_consumers,
    repair_fit,
    repair_sums,
    to_target,
)
from fisherprune.export.shrink import shrink_dry_run
from fisherprune.graph import placement, trace


def _mlp(width: int = 48, depth: int = 5) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 3)).eval()


def _first_channels_pruned(
    rows: int, removed: Callable[[int], int], **shape: int
) -> tuple[nn.Sequential, Tensor, dict]:
    """``_mlp(**shape)`` masked, each mask's first ``removed(its channels)`` channels zeroed,
    and ``rows`` inputs; after a ``gc.collect()``, so that an earlier test's model left in a
    reference cycle is not counted."""
    gc.collect()
    net = _mlp(**shape)
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(1))
    masks = fp.apply_masks(net, x[:1])
    with torch.no_grad():
        for m in masks.values():
            m.mask[: removed(m.num_channels)] = 0.0
    return net, x, masks


def _weight_copies(model: nn.Module, shapes: set[tuple[int, ...]]) -> int:
    """Live tensors (by storage) shaped like one of ``shapes`` that no parameter of ``model``
    holds now: copies of weights. Read as the tensors are held, also inside a torch function
    mode (a half-precision model's float32 check reads its weights through one)."""
    with torch._C.DisableTorchFunction():
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: set[int] = set()
        for obj in gc.get_objects():
            if type(obj) in (Tensor, nn.Parameter) and tuple(obj.shape) in shapes:
                ptr = obj.untyped_storage().data_ptr()
                if ptr not in own:
                    seen.add(ptr)
    return len(seen)


def _bits(t: Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def test_repair_holds_at_most_one_layers_original_weights_at_a_time() -> None:
    """While the repair runs (dense and pruned forwards, one stage per pass, over three fitted
    layers), no more than one copy of a fitted layer's weight is alive beside the model when
    the last but one runs, its original swapped in after every layer before it was refitted:
    the original weights are read back one layer at a time, not held for all fitted layers
    (three copies alive there)."""
    net, x, masks = _first_channels_pruned(64, lambda n: n // 2, depth=4)
    dense = {n: torch.ones_like(m.mask) for n, m in masks.items()}
    linears = [m for m in net if isinstance(m, nn.Linear)]
    shapes = {tuple(m.weight.shape) for m in linears[1:]}
    most = [0]

    def spy(*_: object) -> None:
        most[0] = max(most[0], _weight_copies(net, shapes))

    # registered before the repair's hooks: it runs while the layer's original is swapped in
    handle = linears[-2].register_forward_hook(spy)
    try:
        report = repair_consumers(net, [(x[i : i + 16], None) for i in range(0, 64, 16)], dense)
    finally:
        handle.remove()
    assert report.passes >= 3  # the later passes run through every earlier refitted layer
    assert len(report.layers) + len(report.skipped) == len(linears) - 1
    assert most[0] == 1


def _original_reads(net: nn.Module, batches: list, dense: dict, every: bool) -> list[list[str]]:
    """Run ``repair_consumers``; return, per dense forward, the names of the layers whose
    original weights it read back from disk. ``every``: the dense forward swaps in every
    fitted layer's original (the repair before it read only the refitted ones), the
    reference."""
    from fisherprune.calibrate import repair_store
    from fisherprune.calibrate.repair import ORIGINAL

    reads: list[list[str]] = []
    stored: dict[str, nn.Module] = {}
    put, swapped, read = (getattr(repair_store.LayerStore, a) for a in ("put", "swapped", "_read"))

    def put_spy(self: object, key: str, modules: dict) -> None:
        stored.update(modules if key == ORIGINAL else {})
        put(self, key, modules)

    def swapped_spy(self: object, key: str, modules: dict) -> object:
        reads.append([])
        return swapped(self, key, stored if every else modules)

    def read_spy(self: object, key: str, name: str) -> dict:
        reads[-1].append(name)
        return read(self, key, name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(repair_store.LayerStore, "put", put_spy)
        mp.setattr(repair_store.LayerStore, "swapped", swapped_spy)
        mp.setattr(repair_store.LayerStore, "_read", read_spy)
        repair_consumers(net, batches, dense, holdout=0.0)
    return reads


def test_dense_forwards_read_back_only_refitted_layers_and_repair_as_before() -> None:
    """The repair's dense forwards read back from disk the original weights of the layers an
    earlier pass refitted and of no other (every fitted layer's was read, 125 MiB for a 500M
    Llama's LM head, whose own weights were still its originals), and the repaired weights
    equal, bit for bit, those of the repair whose dense forwards swap in every original."""
    runs = []
    for every in (False, True):
        net, x, masks = _first_channels_pruned(64, lambda n: n // 2, depth=4)
        dense = {n: torch.ones_like(m.mask) for n, m in masks.items()}
        names = [n for n, m in net.named_modules() if isinstance(m, nn.Linear)][1:]
        reads = _original_reads(net, [(x[i : i + 16], None) for i in range(0, 64, 16)], dense,
                                every)  # fmt: skip
        runs.append((net, reads))
    (net, reads), (reference, every_reads) = runs
    stages = [r for r in every_reads if r]  # one dense forward per batch and stage
    assert len(stages) >= 3 * 4 and all(set(r) == set(names[: len(r)]) for r in stages)
    for dense_reads, all_reads in zip(reads, every_reads, strict=True):
        last = all_reads[-1] if all_reads else None  # the stage being fitted: not refitted
        assert dense_reads == [n for n in all_reads if n != last]
    assert sum(map(len, reads)) < sum(map(len, every_reads))
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert _bits(p) == _bits(q)


def test_repair_reads_the_held_out_dense_outputs_back_one_batch_at_a_time() -> None:
    """While the repair runs, no more tensors shaped like a held-out batch's output are alive
    than that batch's own output and the last layer's dense target for it: the dense outputs
    of the two held-out batches (an LM's logits, growing with the calibration tokens) wait on
    disk, not in memory (both were alive through every pass: four at once)."""
    gc.collect()  # an earlier test's model, left in a reference cycle, is not counted
    net = _mlp(depth=3)
    g = torch.Generator().manual_seed(1)
    # every 4th batch is held out (holdout=0.25): those have 5 examples, the others 8
    batches = [(torch.randn(5 if i % 4 == 3 else 8, 8, generator=g), None) for i in range(8)]
    masks = fp.apply_masks(net, batches[0][0][:1])
    with torch.no_grad():
        for m in masks.values():
            m.mask[: m.num_channels // 2] = 0.0
    dense = {n: torch.ones_like(m.mask) for n, m in masks.items()}
    most = [0]

    def spy(*_: object) -> None:
        alive = {
            o.untyped_storage().data_ptr()
            for o in gc.get_objects()
            if type(o) is Tensor and tuple(o.shape) == (5, 3)
        }
        most[0] = max(most[0], len(alive))

    handle = net[-1].register_forward_hook(spy)
    try:
        report = repair_consumers(net, batches, dense)
    finally:
        handle.remove()
    assert report.held_out is not None  # the held-out check ran
    assert 1 <= most[0] <= 2


def test_no_weight_requires_grad_while_signals_are_collected() -> None:
    """Every forward of the signal passes runs with no parameter requiring grad (autograd
    records no weight gradient and keeps no graph for one), yet the masks get their signals;
    the flags come back afterwards."""
    net = _mlp()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2))
    fp.apply_masks(net, x[:1])
    flags: list[bool] = []  # per forward with autograd on: does any weight require grad?

    def spy(mod: nn.Module, _: object) -> None:
        if torch.is_grad_enabled():
            flags.append(any(p.requires_grad for p in mod.parameters()))

    handle = net.register_forward_pre_hook(spy)
    try:
        fp.prune_to_target(
            net, x[:1], [(x[:16], y[:16]), (x[16:], y[16:])], "60%",
            loss_fn=nn.functional.cross_entropy, reconstruct=False,
        )  # fmt: skip
    finally:
        handle.remove()
    assert len(flags) >= 2  # at least one round over the two batches
    assert not any(flags)
    assert all(p.requires_grad for p in net.parameters())
    assert all(p.grad is None for p in net.parameters())


def test_shrink_dry_run_copies_no_weight_and_leaves_a_bf16_model_bitwise_alone() -> None:
    """``apply_masks``' dry run of ``shrink`` on a bf16 model (compared in float32, as
    ``shrink`` does) allocates no copy of any weight it does not slice, and the model keeps
    its parameter objects, dtypes and bits."""
    gc.collect()  # an earlier test's model, left in a reference cycle, is not counted
    net = _mlp(width=40).to(torch.bfloat16)
    x = torch.randn(4, 8).to(torch.bfloat16)
    masks = fp.apply_masks(net, x[:1])
    with torch.no_grad():
        masks[next(iter(masks))].mask[:4] = 0.0
    params = list(net.parameters())
    before = [_bits(p) for p in params]  # not tensors: no weight copy to count
    # the 40 x 40 weights: one mask slices at most two of the three, so one is shared
    shapes = {(40, 40)}
    counts: list[int] = []
    handle = net[0].register_forward_hook(lambda *_: counts.append(_weight_copies(net, shapes)))
    try:
        shrink_dry_run(net, x)
    finally:
        handle.remove()
    assert counts and max(counts) == 0
    assert list(net.parameters()) == params
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert [_bits(p) for p in params] == before


def test_shrink_dry_run_narrows_a_run_of_kept_channels_instead_of_copying() -> None:
    """Where every mask's removed channels are its first ones (as ``apply_masks``' trial
    removes them), the dry run's shrunk copy holds views of the model's weights: no tensor
    shaped like a sliced weight is alive beside the model's own storages while the copy runs
    (each sliced weight was copied), and the model keeps its weights."""
    net, x, _ = _first_channels_pruned(4, lambda n: 4, width=40)
    params = list(net.parameters())
    before = [_bits(p) for p in params]
    sliced = {(36, 8), (36, 36), (3, 36), (36,)}  # every hidden width loses 4 of 40
    counts: list[int] = []
    handle = net[-1].register_forward_hook(lambda *_: counts.append(_weight_copies(net, sliced)))
    try:
        shrink_dry_run(net, x)
    finally:
        handle.remove()
    assert len(counts) >= 2  # the masked model's forwards, then the shrunk copy's
    assert max(counts) == 0
    assert list(net.parameters()) == params
    assert [_bits(p) for p in params] == before


def test_ridge_choice_keeps_one_solution_alive_and_chooses_as_before() -> None:
    """``ridge=None`` tries every ridge of ``RIDGES`` with no earlier solution alive at each
    solve (an output layer's is the width times the vocabulary), and returns the ridge and
    solution the rule gives with every solution kept: the largest ridge within
    ``GAIN_SLACK`` of the best held-out gain, its solution bit for bit."""
    import weakref

    from fisherprune.calibrate.repair_fit import GAIN_SLACK, RIDGES, _conservative
    from fisherprune.calibrate.repair_sums import Solution, Sums

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(200, 12, generator=g), torch.randn(12, 5, generator=g)
    y = x @ w + torch.randn(200, 5, generator=g)
    fit, held = Sums(), Sums()
    fit.add(x[:150], y[:150])
    held.add(x[150:], y[150:])
    alive: list[weakref.ref[Tensor]] = []

    def solve(ridge: float) -> Solution:
        assert all(ref() is None for ref in alive)  # _conservative's: no earlier one alive
        lam = ridge * float(fit.xtx.diagonal().mean())
        a = fit.xtx + lam * torch.eye(12, dtype=torch.float64)
        coef = torch.linalg.solve(a, fit.rhs(slice(None)))
        alive.append(weakref.ref(coef))
        return Solution.of(coef)

    unrepaired = held.error(Solution.of(torch.zeros(12, 5, dtype=torch.float64)))
    ridge, solution = _conservative(solve, held, unrepaired)
    coef = solution.columns(slice(None))
    assert len(alive) == len(RIDGES) + 1
    alive.clear()
    every = []  # the reference: every solution kept (the spy cleared before each solve)
    for r in RIDGES:
        every.append((r, solve(r)))
        alive.clear()
    errors = [held.error(c) for _, c in every]
    bar = min(errors) + GAIN_SLACK * max(unrepaired - min(errors), 0.0)
    want = max((rc for rc, e in zip(every, errors, strict=True) if e <= bar), key=lambda t: t[0])
    assert ridge == want[0]
    assert torch.equal(coef, want[1].columns(slice(None)))


class _WidestFloat64(TorchFunctionMode):
    """Records the most elements of any float64 tensor a torch call returns."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_function__(
        self, func: Callable, types: object, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.dtype == torch.float64:
                self.most = max(self.most, t.numel())
        return out


def test_solve_of_a_wide_output_layer_makes_one_block_of_columns_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Solving and writing the refit of a layer with many outputs (an LM head: the width times
    the vocabulary) makes no float64 tensor larger than one block of ``BLOCK_ELEMENTS`` (the
    whole (features, outputs) solution, its prior and its errors were each made at once), and
    writes the whole-matrix ridge solution."""
    monkeypatch.setattr(repair_sums, "BLOCK_ELEMENTS", 5 * 64)  # 64 of the 400 columns a block
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(6, 400)
    kept = torch.tensor([0, 2, 3, 5])
    x = torch.randn(300, 6, generator=g)
    y = x[:, kept] @ torch.randn(4, 400, generator=g) + 0.1 * torch.randn(300, 400, generator=g)
    fit = repair_fit.LayerFit(layer, kept, dim=1, positions=1)
    fit.add(x, y)
    rows = torch.cat([x[:, kept], torch.ones(300, 1)], 1).double()  # the reference: whole
    w0 = torch.cat([layer.weight[:, kept], layer.bias[:, None]], 1).detach().double().T
    a, b = rows.T @ rows, rows.T @ y.double()
    lam = 0.1 * float(a.diagonal().mean())
    want = torch.linalg.solve(a + lam * torch.eye(5, dtype=torch.float64), b + lam * w0)
    spy = _WidestFloat64()
    with spy:
        mode, *_ = fit.solve_and_set(0.1, rows_per_weight=20.0)
    assert mode == "weights"  # 300 rows for 5 features
    assert 0 < spy.most <= 5 * 64 < 5 * 400
    torch.testing.assert_close(layer.weight[:, kept].double(), want[:4].T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.double(), want[4], rtol=1e-6, atol=1e-6)
    assert not layer.weight[:, [1, 4]].any()


class _LargestNew(TorchDispatchMode):
    """Records the most bytes of any storage an aten op makes (not a view of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(
        self, func: Callable, types: object, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, Tensor)}  # fmt: skip
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in given:
                self.most = max(self.most, t.untyped_storage().nbytes())
        return out


def test_fit_rows_of_a_wide_output_layer_are_checked_finite_without_a_copy_of_the_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adding finite rows of a wide-output layer (an LM head's targets: the tokens times the
    vocabulary) makes no tensor a quarter of the targets' size (``isfinite`` made one as large
    and three a quarter of it), a row whose sum overflows included; and rows holding NaN or
    inf are left out exactly where a per-element check finds them."""
    monkeypatch.setattr(repair_sums, "BLOCK_ELEMENTS", 5 * 16)  # a few columns of X^T Y a block
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(6, 400)
    kept = torch.tensor([0, 2, 3, 5])
    x = torch.randn(300, 6, generator=g)
    y = torch.randn(300, 400, generator=g)
    y[40, :2] = 3e38  # finite, but its sum is inf
    spy = _LargestNew()
    with spy:
        repair_fit.LayerFit(layer, kept, dim=1, positions=1).add(x, y)
    assert 0 < spy.most < y.nbytes // 4
    y[7, 3], y[11, 0], x[20, 2], x[30, 1] = float("nan"), float("inf"), float("-inf"), 1e38
    fit = repair_fit.LayerFit(layer, kept, dim=1, positions=1)
    fit.add(x, y)
    rows = [i for i in range(300) if all(math.isfinite(v) for v in [*x[i, kept], *y[i]])]
    assert 40 in rows and len(rows) == 297  # x[30, 1] is not a kept feature
    assert fit.nonfinite == 3 and fit.count == 297
    want = torch.cat([x[rows][:, kept], torch.ones(297, 1)], 1).double()
    torch.testing.assert_close(fit.sums.xtx, want.T @ want, rtol=1e-5, atol=1e-4)  # float32


def test_label_free_sampling_widens_a_few_positions_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The label-free loss samples an LM's labels from float64 softmaxes of at most
    ``SAMPLE_ELEMENTS`` logits at a time (the whole (N, L, vocab) logits were widened at once,
    twice with their softmax), and draws the labels the whole-tensor draw gives with the same
    seed."""
    monkeypatch.setattr(label_free, "SAMPLE_ELEMENTS", 3 * 50)  # 3 of the 2 x 16 positions
    logits = torch.randn(2, 16, 50, generator=torch.Generator().manual_seed(0))
    spy = _WidestFloat64()
    with spy:
        labels = label_free.LabelFreeLoss("classification", seed=4).sample(logits)
    whole = torch.softmax(logits.double(), -1).reshape(-1, 50)
    want = torch.multinomial(whole, 1, generator=torch.Generator().manual_seed(4))
    assert 0 < spy.most <= 3 * 50 < logits.numel()
    assert torch.equal(labels, want.view(2, 16))


def test_expected_label_directions_widen_a_few_positions_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``labels="expected"`` builds its directions from float64 softmaxes of at most
    ``SAMPLE_ELEMENTS`` logits at a time (it widened the whole logits, with three more
    float64 copies), each ``sum_y eps_y sqrt(p_y) (p - e_y)`` of the noise drawn in order."""
    monkeypatch.setattr(label_free, "SAMPLE_ELEMENTS", 3 * 50)  # 3 of the 2 x 16 positions
    logits = torch.randn(2, 16, 50, generator=torch.Generator().manual_seed(0))
    spy = _WidestFloat64()
    with spy:
        v = label_free.LabelFreeLoss("classification", seed=4, labels="expected").sample(logits)
    g = torch.Generator().manual_seed(4)
    eps = torch.cat([torch.randn(min(3, 32 - i), 50, generator=g, dtype=torch.float64)
                     for i in range(0, 32, 3)])  # fmt: skip
    p = torch.softmax(logits.double(), -1).reshape(-1, 50)
    want = p * (p.sqrt() * eps).sum(-1, keepdim=True) - p.sqrt() * eps
    assert 0 < spy.most <= 3 * 50 < logits.numel()
    torch.testing.assert_close(v, want.float().view(2, 16, 50), rtol=1e-6, atol=1e-7)


def _held_mlp_wide(masks: dict, model: nn.Module, ids: Tensor, layers: nn.ModuleList | None) -> int:
    """Tensors 56 wide (the decoder's MLP width) held for the backward when the loss of a
    signal pass is computed: saved by autograd outside any checkpointed block, or alive as
    Python objects (a mask's aliased input)."""
    from fisherprune.calibrate import estimate_signals
    from fisherprune.calibrate.label_free import LabelFreeLoss

    saved: list[int] = []
    alive: list[int] = []
    label_free_loss = LabelFreeLoss("auto", 0)

    def pack(t: Tensor) -> Tensor:
        if t.dim() == 3 and t.shape[-1] == 56:
            saved.append(1)
        return t

    def loss(out: object, targets: object) -> Tensor:
        wide = [o for o in gc.get_objects() if type(o) is Tensor and o.dim() == 3]
        alive.append(len({t.untyped_storage().data_ptr() for t in wide if t.shape[-1] == 56}))
        return label_free_loss(out, targets)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        estimate_signals(model, masks, [({"input_ids": ids}, None)], loss, fp.criteria.Fisher(),
                         blocks=layers)  # fmt: skip
    return len(saved) + alive[0]


def test_a_checkpointed_signal_pass_holds_no_layers_mlp_activations_for_the_backward() -> None:
    """When the loss of a signal pass whose decoder layers are checkpointed is computed, no
    tensor as wide as a layer's MLP is held for the backward (they are recomputed one layer at
    a time as the backward reaches it); the plain pass holds several per layer."""
    from tests.test_checkpoint_signals import masked_decoder

    model, masks, ids = masked_decoder("llama")
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)  # nothing removed: the masks would alias their inputs
    plain = _held_mlp_wide(masks, model, ids, None)
    assert plain >= 3 * len(model.model.layers)
    assert _held_mlp_wide(masks, model, ids, model.model.layers) == 0


def test_streamed_xty_of_float32_rows_is_held_in_float32_within_its_rounding() -> None:
    """The repair's streamed ``X^T Y`` of float32 rows over 40 batches is held in float32 (an
    LM head's, the width times the vocabulary, was twice its float32 weight in float64 for each
    of the fitting and held-out sums) and equals the float64 product of all rows to float32
    rounding; ``X^T X`` stays float64."""
    from fisherprune.calibrate.repair_sums import Sums

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 12, generator=g) for _ in range(40)]
    ys = [x @ torch.randn(12, 300, generator=g) + torch.randn(64, 300, generator=g) for x in xs]
    sums = Sums()
    for x, y in zip(xs, ys, strict=True):
        sums.add(x, y)
    want = torch.cat(xs).double().T @ torch.cat(ys).double()
    assert sums.xty.dtype == torch.float32 and sums.xtx.dtype == torch.float64
    assert sums.rhs(slice(None)).dtype == torch.float64
    torch.testing.assert_close(
        sums.rhs(slice(None)), want, rtol=0.0, atol=1e-5 * want.abs().max().item()
    )


def test_cost_reports_hold_memory_that_does_not_grow_with_the_prune_steps() -> None:
    """A ``CostModel`` asked for a report after every prune step (as ``prune_to_target``'s
    selection asks) holds, between the 20th and the 120th step, under 4 KiB more Python and
    numpy memory (``tracemalloc``) per step, while its report still equals a fresh cost
    model's. What does grow is a float per new shapes of a term (``_cached_eval``: ~1 KiB a
    step here, capped by ``EVAL_CACHE_SIZE``); keeping every step's channel state of each
    changed term (the old memo: a key of 9 bytes per channel of the term, and 16 more for its
    entries and savings) held ~30 KiB more per step here, growing with the width, until
    ``prune_to_target``'s repair: 166 MiB on a 16-layer Llama of width 512."""
    import tracemalloc

    from fisherprune.cost.model import CostModel

    net, x, masks = _first_channels_pruned(8, lambda n: 0, width=192, depth=6)
    cost = CostModel(net, x[:1], "flops")
    steps = [(m, i) for i in range(40) for m in masks.values()][:120]
    assert len(steps) == 120
    held = []
    tracemalloc.start()
    try:
        for step, (m, i) in enumerate(steps, 1):
            with torch.no_grad():
                m.mask[i] = 0.0
            report = cost.report()
            if step in (20, 120):
                held.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    fresh = CostModel(net, x[:1], "flops").report()
    assert report.total == fresh.total
    for name in masks:
        assert torch.equal(report.marginal[name], fresh.marginal[name])
    per_step = (held[1] - held[0]) / 100
    assert per_step < 4 * 1024, f"{per_step:.0f} bytes more per step"


class _LiveSquares(TorchDispatchMode):
    """Records the most (n, n) float64 storages, other than ``given``'s, that aten ops return
    inside the mode and that are alive at once (by weak reference: each counts until its last
    tensor goes)."""

    def __init__(self, n: int, given: Tensor) -> None:
        super().__init__()
        self.n, self.given, self.most = n, given.untyped_storage().data_ptr(), 0
        self.alive: dict[int, weakref.ref[Tensor]] = {}

    def __torch_dispatch__(
        self, func: Callable, types: object, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.dtype == torch.float64 and t.shape == (self.n,) * 2:
                ptr = t.untyped_storage().data_ptr()
                if ptr != self.given:
                    self.alive.setdefault(ptr, weakref.ref(t))
        self.alive = {p: r for p, r in self.alive.items() if r() is not None}
        self.most = max(self.most, len(self.alive))
        return out


def test_a_scales_solve_makes_one_square_of_its_channels_at_a_time() -> None:
    """Solving one layer's refit in ``"scales"`` mode (40 kept inputs, no bias, too few rows
    for every weight) holds one float64 (channels x channels) square beside its sums' Gram at
    any time: ``W W^T``, then its product with the Gram made in its place, given up to the
    solve for its ridge and factorised in place. The solve kept ``W W^T`` and the product
    apart and ridged a copy made by ``a + lam * eye``: four at once; then two (the system
    and its factors: 242 MiB each for a 1B Llama's first down_proj, the bf16 1B decoder's
    peak); the refit it writes is the same."""
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(48, 30, bias=False)
    x = torch.randn(100, 48, generator=g)
    fit = repair_fit.LayerFit(layer, torch.arange(40), dim=1, positions=1)
    fit.add(x, x @ torch.randn(48, 30, generator=g))
    spy = _LiveSquares(40, fit.sums.xtx)
    with spy:
        mode, before, after, _ = fit.solve_and_set(0.1, rows_per_weight=20.0)
    assert mode == "scales"  # 100 rows for 40 features
    assert after < before  # the refit was kept (and written)
    assert spy.most == 1


@pytest.mark.parametrize("aliased_out", [True, False])
@pytest.mark.parametrize("own", [False, True])
def test_a_singular_system_factorised_in_place_gives_its_minimum_norm_solution(
    own: bool, aliased_out: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ridge 0 and a dead input (a zero row and column), the factorisation in place
    reports the system singular and the solve returns the system's minimum-norm
    least-squares solution (float64 ``lstsq`` of the ridged system), whether the system was
    the caller's to keep (made again from it) or given up (multiplied back from its
    factors); a regular system's solution is ``torch.linalg.solve``'s. The same where the
    backend refuses an ``out`` that aliases the input (the factors are then made apart)."""
    if not aliased_out:
        factor = torch.linalg.lu_factor_ex

        def refuse_aliased(a: Tensor, **kwargs: object) -> object:
            if "out" in kwargs:
                raise RuntimeError("unsupported operation: out aliases the input")
            return factor(a, **kwargs)

        monkeypatch.setattr(torch.linalg, "lu_factor_ex", refuse_aliased)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 6, dtype=torch.float64, generator=g)
    x[:, 2] = 0.0  # a dead input
    a, b = x.T @ x, torch.randn(6, 3, dtype=torch.float64, generator=g)
    fit = repair_fit.LayerFit(nn.Linear(6, 3), torch.arange(6), dim=1, positions=1)
    prior = repair_sums.Solution.of(torch.zeros(6, 3, dtype=torch.float64))
    for ridge in (0.0, 0.5):
        system = a.clone()
        system.diagonal().add_(ridge * float(a.diagonal().mean()))
        given = a.clone()
        got = fit._solve(given, repair_sums.Solution.of(b), ridge, prior, own=own)
        got = got.columns(slice(None))
        if ridge == 0.0:
            want = torch.linalg.lstsq(system, b, driver="gelsd").solution
        else:
            want = torch.linalg.solve(system, b)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        if not own:
            assert torch.equal(given, a)  # the caller's system is left as it was


@pytest.mark.skipif(glibc() is None, reason="malloc_trim is glibc's")
def test_trim_freed_memory_gives_freed_heap_pages_below_a_live_block_back() -> None:
    """100 MiB of 256 KiB blocks served from glibc's heap and freed below a block still in
    use stay resident (the heap shrinks only from its top) until ``trim_freed_memory``, which
    gives at least 80 MiB of them back."""
    torch.ones(1 << 20)  # a 4 MiB mapped block freed: glibc's mmap threshold rises past 256 KiB
    blocks = [torch.ones(64 * 1024) for _ in range(400)]
    # allocated after them, alive through the trim, and of their size, so that it comes from
    # the heap's top above them (a small one may come from a free list elsewhere, and the
    # blocks then sit at the top, where free() itself gives them back)
    pin = torch.ones(64 * 1024)
    del blocks
    before = _resident_mib()
    assert trim_freed_memory()
    assert before - _resident_mib() > 80, "the freed blocks stayed resident"
    assert pin.sum() == 64 * 1024


def _resident_mib() -> float:
    return _status_mib("VmRSS")


def test_repair_trims_the_heap_before_each_pass_and_before_its_solves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The repair gives its freed heap memory back (``trim_freed_memory``) as it starts, again
    after its plan's trace and first forward, before each pass over the calibration batches
    and before that pass's solves: what the selection, a pass and its solves free below a live
    block would otherwise stay resident, pass after pass (on a 1B Llama the repair's resident
    set grew with the depth while its live bytes did not)."""
    net, x, masks = _first_channels_pruned(64, lambda n: n // 2, depth=4)
    dense = {n: torch.ones_like(m.mask) for n, m in masks.items()}
    calls: list[int] = []
    monkeypatch.setattr(repair, "trim_freed_memory", lambda: calls.append(1))
    report = repair_consumers(net, [(x, None)], dense, holdout=0.0)
    assert report.passes == 3
    assert len(calls) == 2 + 2 * report.passes


def test_tracing_trials_and_signal_rounds_give_their_freed_heap_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``apply_masks`` trims the heap after each of its two traces and after its shrink
    trials, and ``prune_to_target`` before each round's signal passes: a trace's freed
    activations otherwise stay resident (300 MiB after a 24-layer decoder's, 38 alive) and
    the next phase's mark starts above them."""
    calls: list[str] = []
    for module, name in ((trace, "trace"), (placement, "trials"), (to_target, "signals")):
        monkeypatch.setattr(module, "trim_freed_memory", lambda n=name: calls.append(n))
    net = _mlp()
    x = torch.randn(16, 8)
    fp.apply_masks(net, x[:2])
    assert calls == ["trace", "trace", "trials"]
    calls.clear()
    result = fp.prune_to_target(
        net, x[:2], [(x, torch.randint(0, 3, (16,)))], "50%", loss_fn=nn.functional.cross_entropy,
        reconstruct=False, rounds=3,
    )  # fmt: skip
    assert calls.count("signals") == result.rounds >= 3


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's peak RSS")
def test_a_symmetric_system_is_factorised_over_its_own_memory() -> None:
    """``factor_in_place`` writes the LU factors of a row-major symmetric system over it
    through its transpose, the column-major layout LAPACK factorises in place: the resident
    set rises by under a tenth of the system's bytes while it runs (a row-major ``out``
    made a column-major copy of the whole square: +73 MiB for a 69 MiB system), and the
    factors solve the system as ``torch.linalg.solve`` does."""
    g = torch.Generator().manual_seed(0)
    n = 2000
    x = torch.randn(n + 10, n, dtype=torch.float64, generator=g)
    a = x.T @ x
    del x
    b = torch.randn(n, 3, dtype=torch.float64, generator=g)
    work = a.clone()
    gc.collect()
    before = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    lu, pivots, info = repair_fit.factor_in_place(work)
    rise = _status_mib("VmHWM") - before
    assert int(info) == 0
    assert lu.untyped_storage().data_ptr() == work.untyped_storage().data_ptr()
    assert rise < 0.1 * n * n * 8 / 2**20, f"the factorisation held {rise:.0f} MiB more"
    want = torch.linalg.solve(a, b)
    torch.testing.assert_close(torch.linalg.lu_solve(lu, pivots, b), want, rtol=1e-6, atol=1e-6)


def _status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1)) / 1024


def test_ordering_the_repair_stages_frees_each_layers_input_and_output_as_the_forward_does() -> (
    None
):
    """The repair's first forward (``stages``: the order of the fitted layers, their grouping
    by input and which outputs feed a residual add) keeps no earlier layer's input or output
    alive: when the last layer is called, none of the first layers' are (they were all held to
    the end of the pass: on a 500M Llama in bf16, 140 MiB over the repair's solves)."""
    from fisherprune.calibrate.repair_plan import layer_fits, stages

    net, x, _ = _first_channels_pruned(4, lambda n: n // 2, width=32, depth=6)
    fits = layer_fits(net, 10, 6144, {})
    linears = [m for m in net if isinstance(m, nn.Linear)]
    refs: list[weakref.ref[Tensor]] = []
    alive_at_last: list[int] = []
    for lin in linears[1:-2]:  # not the first: its input is the caller's
        lin.register_forward_hook(lambda m, a, o: refs.extend(map(weakref.ref, (a[0], o))))
    linears[-1].register_forward_pre_hook(
        lambda m, a: alive_at_last.append(sum(r() is not None for r in refs))
    )
    with torch.no_grad():
        *order, sequence = stages(net, fits, x)
    assert len(refs) == 2 * (len(linears) - 3) and alive_at_last == [0]
    assert sequence == [n for st in order for n in st] and len(sequence) >= len(linears) - 1


def test_prune_to_target_s_repair_reads_its_plan_off_the_selection_s_cost_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``prune_to_target``'s repair builds no cost model of its own (a second one beside the
    selection's held ~100 MiB more on a 500M decoder): it reads the outputs each layer keeps
    off the selection's, and repairs exactly as a repair that traces the model afresh."""
    from fisherprune.cost.model import CostModel
    from fisherprune.export import plan as plan_module

    built: list[str] = []

    class Counted(CostModel):
        def __init__(self, *args: object, **kwargs: object) -> None:
            built.append("built")
            super().__init__(*args, **kwargs)

    inner = to_target.repair_consumers

    def repair_spy(*args: object, **kwargs: object) -> object:
        built.append("repair starts")
        return inner(*args, **kwargs)

    monkeypatch.setattr(plan_module, "CostModel", Counted)
    monkeypatch.setattr(to_target, "repair_consumers", repair_spy)
    net = _mlp()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(3))
    fp.apply_masks(net, x[:2])
    twin = copy.deepcopy(net)
    result = fp.prune_to_target(net, x[:2], [(x, y)], "50%", loss_fn=nn.functional.cross_entropy)
    assert result.repair is not None and result.repair.layers
    assert built[-1] == "repair starts"  # nothing built from there on
    masks = fp.find_masks(net)
    dense = {n: torch.ones_like(m.mask) for n, m in masks.items()}
    with torch.no_grad():  # the twin: the chosen masks, the weights before the repair
        for name, m in fp.find_masks(twin).items():
            m.mask.copy_(masks[name].mask)
    report = repair_consumers(twin, [(x, y)], dense)
    assert set(report.layers) == set(result.repair.layers)
    for (a, pa), (b, pb) in zip(net.named_parameters(), twin.named_parameters(), strict=True):
        assert a == b and torch.equal(pa, pb), a


def test_a_repair_refuses_the_cost_model_of_another_model() -> None:
    """``repair_consumers(cost_model=)`` reads which outputs each layer keeps off the cost
    model's masks: one built on a copy (other masks, other channels kept) is refused, not
    read."""
    from fisherprune.cost.model import CostModel

    net, x, masks = _first_channels_pruned(16, lambda n: n // 2, depth=4)
    other = copy.deepcopy(net)
    dense = {n: torch.ones_like(m.mask) for n, m in masks.items()}
    with pytest.raises(ValueError, match="built on another model"):
        repair_consumers(net, [(x, None)], dense, cost_model=CostModel(other, x[:1], "flops"))
