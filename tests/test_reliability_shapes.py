"""Channels that cannot be kept or reported: an emptied layer, an empty plan entry, and an
LSTM's units read at a width written in the code (issue 19, item 8)."""

from __future__ import annotations

import pytest
import torch

import fisherprune as fp


def test_a_model_with_an_emptied_layer_is_refused_by_shrink_with_the_layer_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    x = torch.randn(3, 4)
    [mask] = fp.apply_masks(model, x).values()
    with torch.no_grad():
        mask.mask.zero_()
    with pytest.raises(ValueError, match=r"0\.weight would keep none of its 6 channels"):
        fp.shrink(model, x)


def test_a_plan_with_an_empty_kept_list_is_refused():
    plan = {"format": 1, "modules": {"fc": {"weight": {"shape": [4, 3], "kept": {"0": []}}}}}
    with pytest.raises(ValueError, match="kept list is empty"):
        fp.PruningPlan.from_dict(plan)


def test_lstm_units_read_at_a_width_written_in_the_code_are_reported_and_refused_when_strict():
    """An LSTM whose outputs the model reshapes at its hidden size written as a number keeps
    its units whole (the shrunk model could not run): reported in ``skipped``, refused under
    ``strict=True``. (Its projected units and cells, where it has ``proj_size``, are masked:
    ``test_recurrent.py``.)"""

    class Recurrent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(4, 5, batch_first=True)
            self.out = torch.nn.Linear(5, 2)

        def forward(self, x):
            return self.out(self.rnn(x)[0].reshape(-1, 5)).view(x.shape[0], -1, 2).mean(1)

    x = torch.randn(2, 3, 4)
    masks = fp.apply_masks(Recurrent(), x)
    assert any("rnn.weight_hh_l0" in str(s) for s in masks.skipped)
    with pytest.raises(ValueError, match=r"rnn\.weight_hh_l0"):
        fp.apply_masks(Recurrent(), x, strict=True)
