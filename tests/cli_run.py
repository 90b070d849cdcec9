"""Run the ``fisherprune`` command line in-process, for tests."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import torch

from fisherprune.cli.main import main


def run_cli(*argv: object) -> tuple[int, str, str]:
    """``fisherprune *argv``: exit code, stdout, stderr. The thread count a run sets is put
    back, so one test's ``--threads`` does not slow the next."""
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()
