"""Measured latency as a cost: per-operator timing tables on the device that serves.

The ``latency`` convention prices every traced operator by timing it, alone, on the device,
dtype and batch a ``LatencySpec`` names, at the widths a prune can reach. An operator's
labelled dimensions are grouped into axes (the channels that move together: a hidden width,
a layer's output channels, a count of heads); each axis is timed in a sweep with the others
dense, at every width when it has at most ``points`` of them, else at ``points`` widths in
steps of ``step`` channels (the pruner's ``round_to``), with linear interpolation between.
The time at several narrower axes is the dense time scaled by each axis' own ratio,
``T(k_1, k_2) = T(n_1, k_2) * T(k_1, n_2) / T(n_1, n_2)``: exact for a product of widths (a
convolution's ``C_in * C_out``) and keeping the staircases each axis shows on its own. The
marginal cost of a channel is then the table's step, so a selection sees that 130 channels
may cost what 136 do.

What the operators' times alone do not include (the Python between them, caches a lone
operator keeps warm and a forward pass does not) is measured once: the dense model is timed
whole, and every operator's time is scaled by the whole over the sum of the operators
(``CostModel.latency_scale``), so that totals and targets (``"12ms"``, ``"50%"`` of the
measured latency) are those of the whole forward pass. That part does not shrink in
proportion with the operators everywhere: ``fisherprune.calibrate.fit_latency_line`` (run by
``prune_to_target`` and both commands unless ``LatencySpec.line_at`` is None) times shrunk
copies whole too and prices a state on the piecewise-linear curve of its operators through
every size (one copy: ``slope x operators + offset``), keeping the dense total. Neither a
scale alone nor an offset alone fits every network: an offset would have been as large as
the sum itself on a small network at batch 1, where a forward pass costs several times its
operators timed alone and shrinks with them (the MobileNetV3 of
``benchmarks/latency_prediction.py``), while BERT-base pruned to a quarter of its operators'
time ran at a third of the dense model.

A table is built in two passes: the second times again every width the first measured, and
the faster of the two is kept, so that a burst of other load during one pass does not price a
run of operators above the rest.

Every timing is kept on disk (``cache``), keyed by the operator, its argument shapes and
dtypes; the file's header names the device, torch version, threads, dtype and form it was
measured under, and a second run on the same model reads every time from it. A file whose
header differs is refused, naming the field; a file that does not match its own checksum is
measured afresh, never trusted.

Operators are timed alone in eager whatever the serving form: the table ranks channels by their
relative cost. A compiled form (``LatencySpec.form``: TorchScript, AOTInductor,
``torch.compile``, CUDA graphs) fuses operators, which the table cannot see, so every timing
of the whole model (the dense total of the scale, both sizes of the line) is taken in that form
(``fisherprune.export.serving_forms``), and the line maps the eager operators' sum to the
served form's time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map

from fisherprune.graph.types import OpRecord, Slot
from fisherprune.inputs import Inputs
from fisherprune.modes import eval_mode
from fisherprune.settings import check_round_to

__all__ = [
    "LatencySpec",
    "LatencyTable",
    "default_cache_dir",
    "prediction_check",
    "prediction_text",
    "round_to_for",
    "served",
    "served_pair",
    "spec_for",
    "timing_threads",
    "whole_model_seconds",
    "with_batch",
]

log = logging.getLogger("fisherprune")

#: serving forms, and the device types each is built on (``fisherprune.export.serving_forms``)
FORMS = {
    "eager": ("cpu", "cuda"),
    "torchscript": ("cpu", "cuda"),
    "aoti": ("cpu",),
    "compile": ("cpu", "cuda"),
    "cuda_graphs": ("cuda",),
}
#: one timed block of an operator lasts at least this long (seconds)
BLOCK_SECONDS = 2e-3
#: table file format
FORMAT = 1
#: widths per axis of the grid an operator's two widest axes are timed on together
GRID = 5

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LatencySpec:
    """Where, and in what form, the ``latency`` cost convention times a model.

    Attributes:
        device: ``"cpu"`` or ``"cuda"`` / ``"cuda:N"``: where the operators are timed (the
            model may live elsewhere; its structure is traced on the CPU either way).
        threads: CPU threads while timing (``torch.set_num_threads``); None: as set now.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the floating dtype the
            operators are timed in; None: each operator's own (the model's).
        batch: examples per forward pass timed; None: the example inputs' batch. The cost is
            seconds per forward pass of this batch, not per example.
        form: how the model is served, and timed whole: ``"eager"``, ``"torchscript"``
            (traced and frozen), ``"aoti"`` (an AOTInductor package; CPU), ``"compile"``
            (``torch.compile``) or ``"cuda_graphs"`` (GPU). Operators are timed alone in eager
            in every form; a compiled form needs ``line_at`` (the eager table alone cannot
            predict a fused form).
        step: widths are timed in steps of this many channels (use the pruner's
            ``round_to``); an axis of at most ``points`` widths is timed at every width.
        points: at most this many widths timed per axis of an operator.
        blocks: timed blocks per width (the fastest is kept: load from other processes only
            adds time); each lasts at least ``BLOCK_SECONDS``.
        cache: a folder for the table files, or one ``.json`` file; None: the folder
            ``$FISHERPRUNE_CACHE/latency`` (default ``~/.cache/fisherprune/latency``).
        line_at: the shares of every prunable width kept in copies of the model that
            ``fisherprune.calibrate.fit_latency_line`` shrinks and times whole beside the dense
            model (``prune_to_target`` and the commands do it): a state is priced on the
            piecewise-linear curve of its operators' sum through the dense model and every
            copy, so a target between two sizes is interpolated; a single share (``0.5``) fits
            the line latency = slope x operators + offset through the dense model and that
            copy; None: the operators scaled in proportion only. Kept as a tuple, widest
            first. Not part of the table's key (the table is per operator).
        checks: states of a ``prune_to_target`` shrunk and timed whole beside the dense model
            before its last goal, the line refitted through each
            (``fisherprune.calibrate.LatencyLoop``), and then the state at the last goal;
            0 (the default): none, the prune aims on the copy's line alone. Experimental: on
            a quiet CPU it brought BERT-base's target error from -6.0 / -5.1% to +4.6 /
            +1.4% (50 / 25%) for about 55 s of checks a prune, but pruned a ResNet-50 whose
            table was timed under load to 37% for 50%.
    """

    device: str = "cpu"
    threads: int | None = None
    dtype: str | None = None
    batch: int | None = None
    form: str = "eager"
    step: int = 8
    points: int = 16
    blocks: int = 5
    cache: str | os.PathLike[str] | None = None
    line_at: float | tuple[float, ...] | None = (0.5, 0.25)
    checks: int = 0

    def __post_init__(self) -> None:
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError, ValueError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ValueError(f"LatencySpec.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"LatencySpec.device {self.device!r}: CUDA is not available here; time on "
                "'cpu', or build the table on the machine that serves"
            )
        for name, low in (("threads", 1), ("batch", 1)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"LatencySpec.{name} must be an int >= {low} or None, got {v!r}")
        for name, low in (("step", 1), ("points", 2), ("blocks", 1), ("checks", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"LatencySpec.{name} must be an int >= {low}, got {v!r}")
        if self.line_at is not None:
            object.__setattr__(self, "line_at", _line_shares(self.line_at))
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(
                f"LatencySpec.dtype must be one of {', '.join(DTYPES)} or None, got {self.dtype!r}"
            )
        if self.form not in FORMS:
            raise ValueError(
                f"LatencySpec.form must be one of {', '.join(FORMS)}, got {self.form!r}"
            )
        if dev.type not in FORMS[self.form]:
            raise ValueError(
                f"LatencySpec.form {self.form!r} is not built on device {self.device!r} (it "
                f"runs on {' or '.join(FORMS[self.form])}); choose another form or device"
            )
        if self.form != "eager" and self.line_at is None:
            raise ValueError(
                f"LatencySpec.form {self.form!r} needs line_at (shares in (0, 1)): the eager "
                "operators' table alone cannot predict a fused form; the line through two "
                "sizes of the model timed in that form maps one to the other"
            )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def line_shares(self) -> tuple[float, ...]:
        """``line_at`` as a tuple of shares, widest first (empty when None)."""
        if self.line_at is None:
            return ()
        return self.line_at if isinstance(self.line_at, tuple) else (self.line_at,)


def _line_shares(line_at: Any) -> float | tuple[float, ...]:
    """``line_at`` checked: a share in (0, 1) as given, or a tuple (or list) of distinct ones
    sorted widest first.

    Raises:
        ValueError: not a share or a sequence of them, an empty sequence, a share outside
            (0, 1), or one given twice (the message names the value).
    """
    many = isinstance(line_at, (tuple, list))
    shares = tuple(line_at) if many else (line_at,)
    for v in shares:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            raise ValueError(
                "LatencySpec.line_at must be a share in (0, 1), a tuple of them, or None; "
                f"got {line_at!r} ({v!r} is not a share in (0, 1))"
            )
    if not shares:
        raise ValueError(
            "LatencySpec.line_at is an empty tuple: give one share or more in (0, 1), or None "
            "to scale the operators in proportion only"
        )
    if len(set(shares)) != len(shares):
        raise ValueError(
            f"LatencySpec.line_at {line_at!r} names a share twice: each copy is timed once"
        )
    return tuple(sorted((float(v) for v in shares), reverse=True)) if many else line_at


def spec_for(conventions: tuple[str | None, ...], what: str, **fields: Any) -> LatencySpec | None:
    """The ``LatencySpec`` of ``fields`` when one of ``conventions`` is ``latency``, else
    None (a command's flags or a run's config build it this way). A ``step`` of None (no
    ``round_to`` given) is the spec's default.

    Raises:
        ValueError: a bad field, the message starting with ``what`` (the flags' or fields'
            name as the user wrote them).
    """
    if "latency" not in conventions:
        return None
    if fields.get("step", 0) is None:
        del fields["step"]
    try:
        return LatencySpec(**fields)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def round_to_for(
    round_to: Any,
    conventions: tuple[str | None, ...],
    latency: LatencySpec | None,
    name: str = "round_to",
) -> int:
    """The pruner's ``round_to``: as given, or for None, the step the latency table is timed
    in (``LatencySpec.step``, 8 by default) when one of ``conventions`` is ``latency``, else
    1. A prune then reaches only widths the table timed: at one CPU thread a decoder whose
    residual width went from 64 to 63 channels ran 16% slower than dense, while a table that
    never times such a width (or smooths its step up away, ``rising``) priced it 1% cheaper
    (docs/benchmarks.md).

    Logs a warning when a given ``round_to`` reaches widths between the table's steps.

    Raises:
        ValueError: not an int >= 1 or None (the message names ``name``).
    """
    step = (latency or LatencySpec()).step if "latency" in conventions else 1
    resolved = check_round_to(round_to, name, default=step)
    if resolved % step:
        log.warning(
            "%s=%d reaches widths between the latency table's steps of %d channels "
            "(LatencySpec.step): they are priced by interpolation, and on a CPU a width off "
            "the step can run slower than a wider one; leave %s unset (it follows the step) "
            "or give a multiple of %d",
            name, resolved, step, name, step,
        )  # fmt: skip
    return resolved


def default_cache_dir() -> Path:
    """``$FISHERPRUNE_CACHE/latency``, else ``$XDG_CACHE_HOME/fisherprune/latency``, else
    ``~/.cache/fisherprune/latency``."""
    root = os.environ.get("FISHERPRUNE_CACHE")
    if root:
        return Path(root) / "latency"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "fisherprune" / "latency"


def _device_name(device: torch.device) -> str:
    """The processor or GPU the times belong to."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _digest(header: dict[str, Any], entries: dict[str, float]) -> str:
    text = json.dumps({"header": header, "entries": entries}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class LatencyTable:
    """Measured seconds per operator call, by a key naming the operator, its arguments, shapes
    and dtypes, measured under ``header`` (device, its name, torch version, threads, dtype,
    form); kept in the file ``path``.

    Use ``LatencyTable.open(spec)``; ``save()`` writes the file (atomically, with a checksum).
    """

    header: dict[str, Any]
    path: Path
    #: the header's digest: the tables of one device, torch version, threads, dtype and form
    key: str
    entries: dict[str, float] = field(default_factory=dict)
    measured: int = 0  # entries added since it was opened
    #: the keys measured since it was opened (``OpTimer``'s second pass times them again)
    fresh: set[str] = field(default_factory=set)
    warned: bool = False  # the machine was found loaded while timing (said once)

    @classmethod
    def open(cls, spec: LatencySpec) -> LatencyTable:
        """The table ``spec`` times into: read from its file when there is one.

        Raises:
            ValueError: the file was measured under another header (the message names the
                first field that differs and both values).
        """
        dev = spec.torch_device
        header = {
            "device": dev.type,
            "device_name": _device_name(dev),
            "torch": torch.__version__,
            "threads": (spec.threads or torch.get_num_threads()) if dev.type == "cpu" else None,
            "dtype": spec.dtype,
            "form": spec.form,
        }
        given = Path(spec.cache) if spec.cache is not None else default_cache_dir()
        key = hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()[:16]
        path = given if given.suffix == ".json" else given / f"{dev.type}-{key}.json"
        table = cls(header, path, key)
        table._load()
        return table

    def _load(self) -> None:
        if not self.path.is_file():
            return
        try:
            data = json.loads(self.path.read_text())
            header, entries = data["header"], data["entries"]
            ok = data.get("format") == FORMAT and data.get("sha256") == _digest(header, entries)
        except (OSError, ValueError, KeyError, TypeError) as e:
            ok, header, entries = False, None, None
            log.debug("latency table %s unreadable: %s", self.path, e)
        if not ok:
            log.warning(
                "latency table %s is damaged (it does not match its checksum): ignoring it "
                "and timing afresh; it is rewritten when the table is saved",
                self.path,
            )
            return
        for k, v in self.header.items():
            if header.get(k) != v:
                raise ValueError(
                    f"latency table {self.path} was measured with {k}={header.get(k)!r}, not "
                    f"{v!r} as now: times from another device, dtype, torch version or thread "
                    "count do not hold here. Give another cache path, or delete the file to "
                    "time afresh"
                )
        self.entries = {str(k): float(v) for k, v in entries.items()}

    def save(self) -> None:
        """Write the table to its file (a temporary file renamed over it). A table that
        cannot be written is kept in memory only, with a warning."""
        if not self.measured and self.path.is_file():
            return
        data = {
            "format": FORMAT,
            "header": self.header,
            "entries": self.entries,
            "sha256": _digest(self.header, self.entries),
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            log.warning("latency table not saved to %s (%s): it will be timed again", self.path, e)

    def save_if_plausible(self, operators: float, whole: float, fused: bool = False) -> bool:
        """``save`` the table, unless its operators timed alone sum to more than
        ``MAX_OPERATOR_EXCESS`` times the model timed whole (``operators`` and ``whole`` in one
        unit): alone, an operator runs without the Python and the cache misses between them,
        so the sum stays below or near the whole; far above it, the operators were timed while
        something else held the CPU (seen: 2-3x on a loaded VM, whose table then mispredicted
        every later run). Such new times are used by this run only (scaled to the whole
        model), never written, and a warning names the ratio and the file; a saved table
        showing it is named too. ``fused``: the model runs some traced operators as one
        fused kernel (a recurrent layer's steps), so its operators may well sum to more than
        the whole on a quiet machine: the table is saved, and the ratio logged at info level.
        Returns whether the table file holds this run's times."""
        if whole <= 0 or operators <= MAX_OPERATOR_EXCESS * whole or fused:
            if fused and whole > 0 and operators > MAX_OPERATOR_EXCESS * whole:
                log.info(
                    "latency: the operators timed alone sum to %.1fx the model timed whole: "
                    "its recurrent layers run their steps as one fused kernel each",
                    operators / whole,
                )
            self.save()
            return True
        fresh = (
            f"the {self.measured} times measured now are not saved to"
            if self.measured
            else ("the times come from")
        )
        log.warning(
            "latency: the operators timed alone sum to %.1fx the model timed whole, which "
            "they cannot on a quiet machine: they were timed while something else ran; %s %s "
            "(%s)",
            operators / whole,
            fresh,
            self.path,
            "this run uses them scaled to the whole model; time on a quiet machine"
            if self.measured
            else "delete it to time afresh on a quiet machine",
        )
        return False

    def warn_if_loaded(self) -> None:
        """Once per table: warn when the CPU is busier than its cores while timing, since
        what is timed now is kept in the table file and read by every later run."""
        if self.warned or not hasattr(os, "getloadavg"):
            return
        load, cpus = os.getloadavg()[0], os.cpu_count() or 1
        if load > cpus:
            self.warned = True
            log.warning(
                "latency: timing operators with the machine loaded (load %.1f on %d CPUs): "
                "the times are kept in %s and read by later runs; time on a quiet machine, "
                "or delete the file to time afresh",
                load,
                cpus,
                self.path,
            )

    def time(
        self, key: str, run: Callable[[], Any], sync: Callable[[], None], blocks: int
    ) -> float:
        """Seconds per call of ``run``: from the table, else measured (one warm-up call, then
        ``blocks`` blocks of at least ``BLOCK_SECONDS``; the fastest) and added. A key the
        table holds as not timed (-1) is measured: the caller has just run it."""
        got = self.entries.get(key)
        if got is None or got < 0:
            self.warn_if_loaded()
            got = self.entries[key] = _measure(run, sync, blocks)
            self.measured += 1
            self.fresh.add(key)
        return got

    def again(
        self, key: str, run: Callable[[], Any], sync: Callable[[], None], blocks: int
    ) -> float:
        """Seconds per call of ``run`` measured once more; the table keeps the faster of that
        and what it held (load only adds time), and returns it. The key is then no longer
        ``fresh``: an operator repeated in the model (a transformer's layers) is timed again
        once, not once per copy."""
        got = self.entries[key] = min(self.entries[key], _measure(run, sync, blocks))
        self.fresh.discard(key)
        return got


#: the most that operators timed alone may sum to, as a multiple of the model timed whole,
#: before their times are taken for ones measured under contention and not saved
MAX_OPERATOR_EXCESS = 1.5


def _measure(run: Callable[[], Any], sync: Callable[[], None], blocks: int) -> float:
    run()
    sync()
    # blocks are sized by the fastest of three single calls: one call that waited for a
    # descheduled thread (milliseconds on a loaded VM) made blocks of one call each
    first = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        sync()
        first = min(first, time.perf_counter() - t0)
    calls = max(1, min(10_000, math.ceil(BLOCK_SECONDS / max(first, 1e-7))))
    if first > 20 * BLOCK_SECONDS:  # a slow call: fewer blocks, each of one call
        blocks = max(3, blocks // 2)
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return min(times)  # other load on a shared machine only ever adds time


@contextlib.contextmanager
def timing_threads(spec: LatencySpec) -> Iterator[None]:
    """Inside the block, torch uses ``spec.threads`` CPU threads (when it names them)."""
    before = torch.get_num_threads()
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# ------------------------------------------------------------------------ axes and sweeps
@dataclass
class Axis:
    """Channels of one operator that move together: the roots (``roots``, sorted) that the
    same labelled dimensions hold, and for each labelled dimension ``j`` of the operator, how
    many of its indices go when the last ``n - k`` roots go (``removed[j][k]``)."""

    roots: np.ndarray
    removed: dict[int, np.ndarray]

    @property
    def n(self) -> int:
        return int(self.roots.size)


def op_axes(dims: list[tuple[int, int, np.ndarray]], prunable: np.ndarray) -> list[Axis]:
    """The axes of an operator whose labelled dimensions are ``dims`` ((slot, dim, root of
    each index)): the roots a prune can remove (``prunable[root]``), grouped by the set of
    dimensions that hold them. A batch, spatial or input dimension has none."""
    if not dims:
        return []
    uniq = [(u := np.unique(r))[prunable[u]] for _s, _d, r in dims]
    if not any(u.size for u in uniq):
        return []
    allr = np.concatenate(uniq)
    which = np.concatenate([np.full(u.size, j, dtype=np.int64) for j, u in enumerate(uniq)])
    roots, inv = np.unique(allr, return_inverse=True)
    inv = inv.reshape(-1)
    if len(dims) <= 62:
        sig = np.zeros(roots.size, dtype=np.int64)
        np.bitwise_or.at(sig, inv, np.left_shift(np.int64(1), which))
    else:  # too many dimensions for a bit set: one axis of every root
        sig = np.zeros(roots.size, dtype=np.int64)
    axes = []
    for s in np.unique(sig):
        members = roots[sig == s]
        removed = {}
        for j, (_s, _d, r) in enumerate(dims):
            pos = np.searchsorted(members, r)
            hit = (pos < members.size) & (members[np.minimum(pos, members.size - 1)] == r)
            if not hit.any():
                continue
            # indices of dim j whose root is the i-th member; going from the end
            counts = np.bincount(pos[hit], minlength=members.size)
            removed[j] = np.concatenate([np.cumsum(counts[::-1])[::-1], [0]])  # by kept k
        axes.append(Axis(members, removed))
    return axes


def sweep_widths(n: int, step: int, points: int) -> list[int]:
    """The widths an axis of ``n`` channels is timed at: every width when there are at most
    ``points``, else ``points`` widths in steps of ``step`` (the dense width always)."""
    if n <= points:
        return list(range(1, n + 1))
    grid = list(range(step, n, step)) or [1]
    if len(grid) >= points:
        idx = np.linspace(0, len(grid) - 1, points - 1).round().astype(int)
        grid = [grid[i] for i in sorted(set(idx.tolist()))]
    return [*grid, n]


def _shapes_at(
    dense: list[tuple[int, ...]],
    dims: list[tuple[int, int, np.ndarray]],
    *kept: tuple[Axis, int],
) -> list[tuple[int, ...]]:
    """The operator's slot shapes with each ``(axis, k)`` of ``kept`` at ``k`` of its
    channels, other axes dense."""
    shapes = [list(s) for s in dense]
    for axis, k in kept:
        for j, removed in axis.removed.items():
            s, d, _r = dims[j]
            shapes[s][d] -= int(removed[k])
    return [tuple(s) for s in shapes]


def _sdpa_for_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``aten._scaled_dot_product_flash_attention_for_cpu``'s call as the public attention,
    which a GPU dispatches to its own kernels (flash, memory-efficient, cuDNN)."""
    q, k, v, *rest = args
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=kwargs.get("attn_mask"), dropout_p=rest[0] if rest else 0.0,
        is_causal=rest[1] if len(rest) > 1 else False, scale=kwargs.get("scale"),
    )  # fmt: skip


#: operators a CPU trace records (the tracer always runs on the CPU) that have no kernel on
#: another device, each with the call that stands for it there (its first output only)
_SDPA_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
DEVICE_TWINS: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Any]] = (
    {_SDPA_CPU.default: _sdpa_for_cpu} if _SDPA_CPU is not None else {}
)


class OpTimer:
    """Times traced operators at given slot shapes on ``spec``'s device, through ``table``."""

    def __init__(self, spec: LatencySpec, table: LatencyTable) -> None:
        self.spec, self.table = spec, table
        self.device = spec.torch_device
        self.sync = _sync(self.device)
        self.dtype = DTYPES.get(spec.dtype) if spec.dtype else None
        #: the second pass of a build: what the first measured is timed again (``again``)
        self.second = False

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def _tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(shape, dtype=dtype, device=self.device)
        if dtype == torch.bool:
            return torch.ones(shape, dtype=dtype, device=self.device)
        return torch.zeros(shape, dtype=dtype, device=self.device)  # indices: 0 is valid

    def seconds(
        self, rec: OpRecord, dense: list[tuple[int, ...]], shapes: list[tuple[int, ...]]
    ) -> float | None:
        """Seconds per call of ``rec``'s operator with its slots at ``shapes`` (``dense``:
        as traced); None when it cannot be run alone at them (it raised, or gave outputs of
        other shapes than ``shapes`` says)."""
        n_in = rec.n_inputs
        dtypes = [self._dtype(t) for t in rec.dtypes] or [torch.float32] * len(shapes)
        sizes = _size_map(dense[:n_in], shapes[:n_in])
        key = json.dumps([str(rec.op), _arg_text(rec.args, rec.kwargs, sizes), shapes,
                          [str(t) for t in dtypes]])  # fmt: skip
        twin = DEVICE_TWINS.get(rec.op) if self.device.type != "cpu" else None
        known = self.table.entries.get(key)
        again = self.second and known is not None and known >= 0 and key in self.table.fresh
        # (a table from before a twin was known holds -1 for it: that is timed again)
        if known is not None and (known >= 0 or twin is None) and not again:
            return known if known >= 0 else None
        try:
            ins = [self._tensor(s, t) for s, t in zip(shapes[:n_in], dtypes[:n_in], strict=True)]
            args, kwargs = _arguments(rec, ins, sizes)
            want = [tuple(s) for s in shapes[n_in:]]
            call: Callable[[], Any] = lambda: rec.op(*args, **kwargs)  # noqa: E731
            if twin is not None:  # a CPU-only kernel: timed as this device runs the same call
                call, want = (lambda: twin(args, kwargs)), want[:1]
            with torch.inference_mode():
                out = call()
                got = [tuple(o.shape) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
                if got != want:
                    raise ValueError(f"outputs {got}, expected {want}")
                if again:
                    return self.table.again(key, call, self.sync, self.spec.blocks)
                return self.table.time(key, call, self.sync, self.spec.blocks)
        except Exception as e:  # any operator that cannot run alone at these shapes
            log.debug("latency: %s not timed at %s: %s", rec.op, shapes, e)
            self.table.entries[key] = -1.0  # remembered: not timed again
            self.table.measured += 1
            return None


def _size_map(dense: list[tuple[int, ...]], now: list[tuple[int, ...]]) -> dict[int, int]:
    """Dense size -> new size of the input dimensions that changed, where a dense size
    changed to one new size only (integer arguments equal to it are sizes to follow)."""
    seen: dict[int, set[int]] = {}
    for a, b in zip(dense, now, strict=True):
        for x, y in zip(a, b, strict=True):
            if x != y:
                seen.setdefault(x, set()).add(y)
    return {x: next(iter(ys)) for x, ys in seen.items() if len(ys) == 1 and x > 1}


def _follow(sizes: dict[int, int]) -> Callable[[Any], Any]:
    def sub(a: Any) -> Any:
        if isinstance(a, int) and not isinstance(a, bool):
            return sizes.get(a, a)
        return a

    return sub


def _arguments(
    rec: OpRecord, ins: list[torch.Tensor], sizes: dict[int, int]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``rec``'s arguments with slots replaced by ``ins`` and sizes followed."""
    follow = _follow(sizes)

    def sub(a: Any) -> Any:
        return ins[a.i] if isinstance(a, Slot) else follow(a)

    return tree_map(sub, rec.args), tree_map(sub, rec.kwargs)


def _arg_text(args: Any, kwargs: Any, sizes: dict[int, int]) -> str:
    follow = _follow(sizes)

    def sub(a: Any) -> Any:
        return "<t>" if isinstance(a, Slot) else follow(a)

    return repr((tree_map(sub, args), tree_map(sub, kwargs)))


# ------------------------------------------------------------------------------ lookups
#: the unit of the ``latency`` convention, in seconds: costs are microseconds, so that a
#: channel's marginal cost stays far above the scores' 1e-6 guard against a cost of 0
UNIT = 1e-6


@dataclass
class OpLatency:
    """The timed cost of one operator: ``dense`` microseconds, and per axis the widths timed
    and the microseconds at each (others dense), never rising as the width falls.
    ``__call__`` takes the kept count of each axis."""

    dense: float
    widths: list[np.ndarray]
    seconds: list[np.ndarray]
    #: for an operator of two or more axes: the two widest (``pair``), a coarse grid of
    #: their widths (``grid``) and, on it, how far the time departs from the separable
    #: product (``joint``: 1 where it holds; above 1 where narrow kernels lose efficiency
    #: together, as a small matrix product does)
    pair: tuple[int, int] | None = None
    grid: tuple[np.ndarray, np.ndarray] | None = None
    joint: np.ndarray | None = None
    #: what every time is multiplied by (the model timed whole over its operators alone)
    scale: float = 1.0

    def __call__(self, kept: torch.Size | tuple[int, ...]) -> float:
        if self.dense <= 0:
            return 0.0
        if any(k <= 0 for k in kept):
            return 0.0  # a width with nothing left: the operator is gone
        t = self.dense
        for k, w, s in zip(kept, self.widths, self.seconds, strict=True):
            t *= float(np.interp(k, w, s)) / self.dense
        if self.pair is not None and self.grid is not None and self.joint is not None:
            t *= _bilinear(self.grid, self.joint, kept[self.pair[0]], kept[self.pair[1]])
        return t * self.scale


def _bilinear(grid: tuple[np.ndarray, np.ndarray], values: np.ndarray, a: float, b: float) -> float:
    """``values`` (over ``grid[0] x grid[1]``) interpolated bilinearly in the logarithm of
    the widths at ``(a, b)``, held at the edges."""
    la, lb = np.log(grid[0]), np.log(grid[1])
    rows = np.array([np.interp(math.log(b), lb, row) for row in values])
    return float(np.interp(math.log(a), la, rows))


def joint_widths(n: int, step: int, count: int) -> list[int]:
    """The widths of an axis of ``n`` channels on the joint grid: every width when there
    are at most ``count``, else halvings of ``n`` (``n / 2**i``, in steps of ``step``):
    the efficiency a narrow kernel loses grows as the width falls, so the grid is dense
    where it is narrow."""
    if n <= count:
        return list(range(1, n + 1))
    widths = {n}
    for i in range(1, count):
        w = n / 2**i
        widths.add(max(step, round(w / step) * step) if w >= step else max(1, int(w)))
    return sorted(widths)


def time_op(
    timer: OpTimer,
    rec: OpRecord,
    dims: list[tuple[int, int, np.ndarray]],
    dense: list[tuple[int, ...]],
    axes: list[Axis],
) -> OpLatency:
    """``rec`` timed dense and along each of its ``axes``. An operator that cannot be run
    alone at a width is priced by the elements it reads and writes there, relative to its
    dense time (0 when it cannot be run at all)."""
    spec = timer.spec
    t0 = timer.seconds(rec, dense, dense)
    widths, seconds = [], []
    for axis in axes:
        ks = sweep_widths(axis.n, spec.step, spec.points)
        ts = []
        for k in ks:
            shapes = _shapes_at(dense, dims, (axis, k))
            t = timer.seconds(rec, dense, shapes) if t0 is not None else None
            if t is None:  # priced by the elements it moves
                t = (t0 or 0.0) * _elements(shapes) / max(1, _elements(dense))
            ts.append(t / UNIT)
        widths.append(np.asarray(ks, dtype=np.float64))
        # a narrower operator never costs more: the noise that says otherwise is averaged out
        seconds.append(rising(np.asarray(ts, dtype=np.float64)))
    timed = OpLatency((t0 or 0.0) / UNIT, widths, seconds)
    if len(axes) >= 2 and t0:
        _time_jointly(timer, rec, dims, dense, axes, timed)
    return timed


def _time_jointly(
    timer: OpTimer,
    rec: OpRecord,
    dims: list[tuple[int, int, np.ndarray]],
    dense: list[tuple[int, ...]],
    axes: list[Axis],
    timed: OpLatency,
) -> None:
    """Time ``rec`` with its two widest axes narrowed together, on a grid of ``GRID``
    widths each (``joint_widths``), and keep on ``timed`` the ratio of each time to the
    separable product of the two sweeps (1 on the dense row and column). Where the operator
    cannot be run at a grid point the ratio is 1."""
    a, b = sorted(range(len(axes)), key=lambda j: -axes[j].n)[:2]
    # only widths the sweeps reach: below an axis' narrowest timed width its sweep is held
    # flat, and a ratio taken there would be spread by the interpolation to widths above it
    ga = [w for w in joint_widths(axes[a].n, timer.spec.step, GRID) if w >= timed.widths[a][0]]
    gb = [w for w in joint_widths(axes[b].n, timer.spec.step, GRID) if w >= timed.widths[b][0]]
    joint = np.ones((len(ga), len(gb)))
    for i, ka in enumerate(ga[:-1]):
        for j, kb in enumerate(gb[:-1]):
            t = timer.seconds(rec, dense, _shapes_at(dense, dims, (axes[a], ka), (axes[b], kb)))
            kept = [axis.n for axis in axes]
            kept[a], kept[b] = ka, kb
            apart = OpLatency(timed.dense, timed.widths, timed.seconds)(tuple(kept))
            if t is not None and apart > 0:
                joint[i, j] = t / UNIT / apart
    timed.pair = (a, b)
    timed.grid = (np.asarray(ga, dtype=np.float64), np.asarray(gb, dtype=np.float64))
    timed.joint = joint


def rising(values: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest ``values`` in squared error (isotonic regression
    by pooling adjacent violators): a run of widths whose times fall as the width grows is
    replaced by its mean."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values.tolist():
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return np.concatenate([np.full(int(c), m) for m, c in blocks]) if blocks else values


def _elements(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def with_batch(example_inputs: Any, batch: int) -> Any:
    """``example_inputs`` with ``batch`` examples: batch tensors repeated (and cut) along
    dim 0; other arguments as they are."""
    inputs = Inputs.of(example_inputs)
    times = -(-batch // inputs.batch_size)
    return inputs.repeated(times).map_leaves(lambda x, b: x[:batch] if b else x).packed()


@dataclass
class ServedForm:
    """A model built in a serving form, with the inputs it runs on.

    Attributes:
        form: the ``LatencySpec.form`` it was built in.
        run: one forward pass on those inputs (call it in inference mode).
        module: the module whose train/eval flag must be eval while ``run`` is timed (eager),
            else None (a compiled form was built in eval mode).
        keep: what must live as long as ``run`` and ``run`` does not hold (a package's
            folder; a CUDA graph's module, inputs and outputs, which it replays into).
    """

    form: str
    run: Callable[[], Any]
    module: torch.nn.Module | None = None
    keep: list[Any] = field(default_factory=list)


#: what builds a model in a serving form: ``fisherprune.export.serving_forms.serve``, which
#: registers itself when the export package is imported (it imports the cost models, so they
#: cannot import it)
_SERVING: list[Callable[[torch.nn.Module, Any, LatencySpec], ServedForm]] = []


def register_serving(build: Callable[[torch.nn.Module, Any, LatencySpec], ServedForm]) -> None:
    """Make ``build(model, example_inputs, spec)`` the builder of serving forms (one at a
    time: a second registration replaces the first)."""
    _SERVING[:] = [build]


def _serve(model: torch.nn.Module, example_inputs: Any, spec: LatencySpec) -> ServedForm:
    if not _SERVING:
        raise RuntimeError(
            "no serving-form builder is registered: import fisherprune (or "
            "fisherprune.export) before timing a model whole"
        )
    return _SERVING[0](model, example_inputs, spec)


def whole_model_seconds(model: Any, example_inputs: Any, spec: LatencySpec) -> float:
    """Seconds per forward pass of ``model`` on ``example_inputs`` in eval mode, in
    ``spec``'s form, device and dtype (``fisherprune.export.serving_forms.serve``: a copy where
    the form or the device needs one; the model itself is left as it was): the fastest of
    ``2 * spec.blocks`` blocks, never cached (it is what the operators' table is checked
    against). ``model`` may be a ``ServedForm`` built already (it runs on its own inputs;
    ``example_inputs`` are then not read), so that a form compiled once is timed again."""
    served = model if isinstance(model, ServedForm) else _serve(model, example_inputs, spec)
    modules = [served.module] if served.module is not None else []
    with eval_mode(*modules), torch.inference_mode():
        return _measure(served.run, _sync(spec.torch_device), 2 * spec.blocks)


def served_pair(
    dense: torch.nn.Module, small: torch.nn.Module, example_inputs: Any, spec: LatencySpec
) -> tuple[Any, Any]:
    """``dense`` and ``small`` as ``whole_model_seconds`` times them again and again, each
    built once in ``spec.form`` (``served``)."""
    return served(dense, example_inputs, spec), served(small, example_inputs, spec)


def served(module: torch.nn.Module, example_inputs: Any, spec: LatencySpec) -> Any:
    """``module`` as ``whole_model_seconds`` times it again and again: in eager the module
    itself, or a copy shrunk at its masks where it has any (a mask's hook is not served);
    else built once in ``spec.form`` (``ServedForm``)."""
    form = _serve(module, example_inputs, spec)
    return form.module if spec.form == "eager" else form


def prediction_check(
    predicted_dense: float,
    predicted: float,
    dense: torch.nn.Module,
    small: torch.nn.Module,
    example_inputs: Any,
    spec: LatencySpec,
) -> dict[str, Any]:
    """The table's prediction (``predicted_dense`` and ``predicted``, in the convention's
    microseconds) beside the dense and the shrunk model timed whole in ``spec`` (at its
    batch, the example repeated to it; dense and shrunk alternately, three times each, the
    fastest kept), in milliseconds, with the prediction's error (predicted over measured,
    less 1) and both shares of the dense (the share cancels a drift of the machine's speed
    between the table's timing and now)."""
    inputs = with_batch(example_inputs, spec.batch or Inputs.of(example_inputs).batch_size)
    dense_s, small_s = [], []
    with timing_threads(spec):
        timed_dense, timed_small = served_pair(dense, small, inputs, spec)
        for _ in range(3):
            dense_s.append(whole_model_seconds(timed_dense, inputs, spec))
            small_s.append(whole_model_seconds(timed_small, inputs, spec))
    ms = UNIT * 1e3
    measured, measured_dense = min(small_s) * 1e3, min(dense_s) * 1e3
    return {
        "spec": spec_fields(spec),
        "dense_predicted_ms": predicted_dense * ms,
        "dense_measured_ms": measured_dense,
        "pruned_predicted_ms": predicted * ms,
        "pruned_measured_ms": measured,
        "prediction_error": predicted * ms / measured - 1 if measured > 0 else None,
        "predicted_share": predicted / predicted_dense if predicted_dense > 0 else None,
        "measured_share": measured / measured_dense if measured_dense > 0 else None,
    }


def prediction_text(check: dict[str, Any]) -> str:
    """One line: predicted and measured latency of the shrunk model, at its spec."""
    spec, err = check["spec"], check["prediction_error"]
    share = ""
    if check["predicted_share"] is not None and check["measured_share"] is not None:
        share = (
            f"; of the dense: predicted {check['predicted_share']:.1%}, measured "
            f"{check['measured_share']:.1%}"
        )
    return (
        f"latency on {spec['device']} at batch {spec['batch']}: predicted "
        f"{check['pruned_predicted_ms']:.3f} ms, measured {check['pruned_measured_ms']:.3f} ms"
        + (f" ({err:+.1%})" if err is not None else "")
        + f"; dense predicted {check['dense_predicted_ms']:.3f} ms, measured "
        f"{check['dense_measured_ms']:.3f} ms{share}"
    )


def spec_fields(spec: LatencySpec) -> dict[str, Any]:
    """``spec`` as plain JSON-able fields (for reports and saved state)."""
    out = asdict(spec)
    out["cache"] = None if spec.cache is None else str(spec.cache)
    return out
