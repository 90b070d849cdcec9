"""The Fisher signal where the batch is not dim 0 of a mask's input, or not dim 0 of the first
input: PyTorch's own ``nn.TransformerEncoder`` in its default (L, N, E) layout (masks on the
hidden width, the heads of ``nn.MultiheadAttention`` whose projections run inside
``F.multi_head_attention_forward``, and the feed-forward units), and a model handed an unbatched
``position_ids`` of shape (1, L) before its ``input_ids``. Each signal is checked against the
per-example float64 loop of ``tests.test_token_rows``; every model is traced at batch 2 and run
at batch 3 (another sequence length too), so that a batch mix-up shows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.masks.points import find_holder
from tests.test_token_rows import ATOL64, RTOL64, _assert_signals, _reference, _signals


class SeqClassifier(nn.Module):
    """(N, L, 6) -> ``nn.TransformerEncoder`` (d_model 16, 2 heads, feed-forward 32, 2 layers)
    in the layout ``batch_first`` says -> a classifier over the mean token."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(6, 16)
        layer = nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, batch_first=batch_first
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x if self.batch_first else x.transpose(0, 1))  # (N, L, E) or (L, N, E)
        return self.head(self.encoder(h).mean(1 if self.batch_first else 0))


@pytest.mark.parametrize("traced", [2, 1], ids=["traced_2", "traced_1"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_signal_equals_per_example_loop(batch_first: bool, traced: int) -> None:
    """Every mask of ``nn.TransformerEncoder`` (hidden width, heads, feed-forward units) has
    the per-example loop's signal in both layouts, and no point's rows are left unknown, also
    when the masks were found with one example (where the batch dim of an (L, 1, E) tensor
    cannot be told from the others: ``apply_masks`` traces the batch twice over then)."""
    torch.manual_seed(0)
    model = SeqClassifier(batch_first).double()
    masks = fp.apply_masks(model, torch.randn(traced, 7, 6, dtype=torch.float64))
    x = torch.randn(3, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1])

    def loss_of(i: int) -> Tensor:
        return F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])

    want = _reference(masks, [(i,) for i in range(3)], loss_of)
    got = _signals(masks, F.cross_entropy(model(x), y))
    assert "unknown" not in {mp.rows.kind for mp in find_holder(model)[1].points}
    _assert_signals(got, want, RTOL64, ATOL64)


@pytest.mark.parametrize("batch_first", [True, False])
def test_attention_points_read_the_batch_where_it_is(batch_first: bool) -> None:
    """Where the masks land and which dim of their input is the batch: the attention's input
    and the feed-forward Linears read (L, N, E) in the sequence-first layout (dim 1), the
    output projection (called by the head-by-head attention on (N, L, E)) and the classifier
    head read dim 0."""
    torch.manual_seed(0)
    model = SeqClassifier(batch_first)
    fp.apply_masks(model, torch.randn(2, 7, 6))
    got = {mp.module_name: (mp.rows.kind, mp.rows.dim) for mp in find_holder(model)[1].points}
    seq = 0 if batch_first else 1
    layer = {"self_attn": seq, "self_attn.out_proj": 0, "linear1": seq, "linear2": seq}
    want = {f"encoder.layers.{i}.{k}": ("batch", d) for i in range(2) for k, d in layer.items()}
    assert got == {**want, "head": ("batch", 0)}


class PositionsFirst(nn.Module):
    """``forward(position_ids (1, L), input_ids (N, L))``: position plus token embeddings,
    tokens flattened through an MLP (``h.view(-1, H)``: its rows are N runs of L tokens, so the
    runtime batch decides which rows are summed), a classifier over the mean token."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(11, 8), nn.Embedding(16, 8)
        self.up, self.down, self.head = nn.Linear(8, 12), nn.Linear(12, 8), nn.Linear(8, 3)

    def forward(self, position_ids: Tensor, input_ids: Tensor) -> Tensor:
        h = self.pos(position_ids) + self.tok(input_ids)  # (N, L, 8)
        n, length, d = h.shape
        t = self.down(torch.relu(self.up(h.view(-1, d)))).view(n, length, d)
        return self.head((h + t).mean(1))


def test_unbatched_first_input_does_not_set_the_batch() -> None:
    """``position_ids`` of shape (1, L) before ``input_ids`` (N, L): the batch is N (traced
    at 2, run at 3), the flattened tokens' rows are followed, and every signal is the
    per-example loop's."""
    torch.manual_seed(0)
    model = PositionsFirst().double()
    gen = torch.Generator().manual_seed(1)
    masks = fp.apply_masks(
        model, (torch.arange(7)[None], torch.randint(0, 11, (2, 7), generator=gen))
    )
    pos, ids, y = (
        torch.arange(5)[None],
        torch.randint(0, 11, (3, 5), generator=gen),
        torch.tensor([0, 2, 1]),
    )

    def loss_of(i: int) -> Tensor:
        return F.cross_entropy(model(pos, ids[i : i + 1]), y[i : i + 1])

    want = _reference(masks, [(i,) for i in range(3)], loss_of)
    got = _signals(masks, F.cross_entropy(model(pos, ids), y))
    assert {mp.rows.kind for mp in find_holder(model)[1].points} == {"tokens", "batch"}
    _assert_signals(got, want, RTOL64, ATOL64)


class SeqFirstEncoder(nn.Module):
    """(N, L, 6) -> a sequence-first ``nn.TransformerEncoder`` whose (L, N, 16) output the
    model returns: the hidden width is masked in the returned tensor too."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(self.embed(x.transpose(0, 1)))


@pytest.mark.parametrize("traced", [2, 1], ids=["traced_2", "traced_1"])
def test_sequence_first_model_output_signal_equals_per_example_loop(traced: int) -> None:
    """A mask on a returned (L, N, E) tensor reads the batch on dim 1 (each of the L rows
    taken for an example before) and gathers the per-example loop's signal, with the masks
    found from a batch of one example as from two."""
    torch.manual_seed(0)
    model = SeqFirstEncoder().double()
    masks = fp.apply_masks(model, torch.randn(traced, 7, 6, dtype=torch.float64))
    holder = find_holder(model)[1]
    outputs = [mp for ps in holder.outputs.values() for mp in ps]
    assert outputs and {(mp.rows.kind, mp.rows.dim) for mp in outputs} == {("batch", 1)}
    x = torch.randn(3, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def loss_of(i: int) -> Tensor:
        return (model(x[i : i + 1]) @ w).square().mean()

    want = _reference(masks, [(i,) for i in range(3)], loss_of)
    out = model(x) @ w  # (L, N): the per-example losses averaged over the batch
    got = _signals(masks, out.square().mean(0).mean())
    _assert_signals(got, want, RTOL64, ATOL64)


def test_a_model_that_refuses_a_batch_of_two_keeps_its_layouts_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found with one example, a sequence-first model that raises on any other batch leaves
    the points it could not tell unknown (as before the batch of two was tried), with a
    warning that names the error."""

    class OneAtATime(SeqClassifier):
        def forward(self, x: Tensor) -> Tensor:
            if x.shape[0] != 1:
                raise RuntimeError("this model takes one example")
            return super().forward(x)

    torch.manual_seed(0)
    model = OneAtATime(batch_first=False).double()
    with caplog.at_level("WARNING", logger="fisherprune"):
        fp.apply_masks(model, torch.randn(1, 7, 6, dtype=torch.float64))
    assert "unknown" in {mp.rows.kind for mp in find_holder(model)[1].points}
    assert "this model takes one example" in caplog.text


class _Probe(nn.Module):
    """Attention pooling by a learned probe repeated over the batch (SigLIP's head): the
    probe meets the key projection's weight, which reads the hidden width, with no
    activation between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.probe = nn.Parameter(torch.randn(1, 1, 8))
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        p = self.probe.repeat(x.shape[0], 1, 1)
        return self.head(self.attn(p, h, h)[0][:, 0])


def test_masks_found_at_a_batch_of_one_are_those_found_at_a_batch_of_three() -> None:
    """A parameter repeated over the batch traces at a batch of three as at a batch of one:
    the same masks, the heads' among them (its dim of one, tiled to the batch, counted as a
    channel at three and was merged with the heads, which were then refused)."""
    found = {n: sorted(fp.apply_masks(_Probe(), torch.randn(n, 4, 6))) for n in (1, 3)}
    assert found[1] == found[3]
    assert "fisherprune_masks.attn:out" in found[1]


def test_a_parameter_met_by_a_weight_is_masked_where_it_enters() -> None:
    """The probe and the key/value weight columns it meets share the hidden width, and no
    activation lies between them: the hidden width is masked at the attention's query input
    too, so the shrunk model gives the masked model's outputs (the width was kept whole: the
    masked model kept the probe's channel the shrunk model removed)."""
    model, x = _Probe(), torch.randn(5, 4, 6)
    masks = fp.apply_masks(model, x[:1])
    (hidden,) = [k for k in masks if "embed" in k]
    with torch.no_grad():
        masks[hidden].mask[[1, 4]] = 0.0
        small = fp.shrink(model, x)
        torch.testing.assert_close(small(x), model(x))
    assert small.probe.shape[-1] == 6
