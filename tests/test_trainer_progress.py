"""The progress display: tqdm's bar when installed, the built-in bar otherwise; lines printed
while a bar is open stay whole lines."""

from __future__ import annotations

import io

import pytest

from fisherprune.train import progress as progress_module
from fisherprune.train.progress import Progress


def _run(stream: io.StringIO) -> None:
    p = Progress(20, "bar", stream=stream)
    for step in range(1, 21):
        p.update(step, f"loss {1 / step:.3f}")
        if step == 10:
            p.line("step 10: eval accuracy 0.5000")
    p.close()


def test_tqdm_bar_reaches_the_total_and_keeps_lines_whole() -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    _run(out)
    text = out.getvalue()
    assert "20/20" in text and "loss 0.050" in text
    assert "\nstep 10: eval accuracy 0.5000\n" in "\n" + text.replace("\r", "\n")


def test_without_tqdm_the_built_in_bar_is_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_module, "tqdm", None)
    out = io.StringIO()
    _run(out)
    text = out.getvalue()
    assert "step 10: eval accuracy 0.5000\n" in text
    assert "] 1/20 loss 1.000" in text  # the first update is drawn at once
    assert text.endswith("\n")


@pytest.mark.parametrize("mode", ["plain", "none"])
def test_plain_and_none_draw_no_bar(mode: str) -> None:
    out = io.StringIO()
    p = Progress(5, mode, stream=out)
    p.update(3, "loss 1")
    p.line("hello")
    p.close()
    assert out.getvalue() == ("hello\n" if mode == "plain" else "")
