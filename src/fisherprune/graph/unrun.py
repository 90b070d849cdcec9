"""Copies of a module that did not run in the trace: experts a router sent no example to.

A mixture-of-experts layer written as an ``nn.ModuleList`` (or ``nn.ModuleDict``) of expert
modules calls only the experts its router picks (SwitchTransformers, NLLB-MoE, most research
code). The trace sees the experts the example inputs reach, and only theirs: an expert left out
reads the hidden width as its copies do, but nothing ties its weights to that width, so a
``shrink`` that narrows the width leaves them wide, and the shrunk model fails (or, where the
check's inputs reach no such expert either, is exported and fails later) once the router
picks it. ``unrun_copy_reasons`` finds, for each channel group, whether it reaches outside a
module that ran while a copy of that module did not: such a group is kept whole, with the
reason. A group inside one expert (its own hidden units) stays prunable.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from fisherprune.graph.groups import ChannelGroup
from fisherprune.graph.trace import Trace

__all__ = ["unrun_copies", "unrun_copy_reasons"]


def _ran(trace: Trace) -> set[str]:
    """The modules that ran: every module called, and every module above one (a container
    is not called itself)."""
    out: set[str] = set()
    for call in trace.calls:
        parts = call.name.split(".")
        out.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    return out


def unrun_copies(model: nn.Module, trace: Trace) -> dict[str, list[str]]:
    """For each module of an ``nn.ModuleList`` or ``nn.ModuleDict`` that ran, the copies
    beside it (same class, same parameter shapes) that did not."""
    ran = _ran(trace)
    out: dict[str, list[str]] = {}
    for name, parent in model.named_modules():
        if not isinstance(parent, (nn.ModuleList, nn.ModuleDict)):
            continue
        copies: dict[tuple, list[str]] = defaultdict(list)
        for child_name, child in parent.named_children():
            shapes = tuple((k, tuple(p.shape)) for k, p in child.named_parameters())
            if shapes:
                copies[(type(child), shapes)].append(f"{name}.{child_name}" if name else child_name)
        for names in copies.values():
            idle = [n for n in names if n not in ran]
            if idle:
                out.update({n: idle for n in names if n in ran})
    return out


def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ""


def unrun_copy_reasons(
    model: nn.Module,
    trace: Trace,
    groups: list[ChannelGroup],
    copies: dict[str, list[str]] | None = None,
) -> dict[int, str]:
    """Why each group (by index) must stay whole: it holds parameters of a module that ran and
    of modules outside it, while a copy of that module did not run, so the copy's weights of
    that width are not followed. Groups that need no such reason are left out. ``copies``:
    ``unrun_copies(model, trace)``, when the caller has it."""
    copies = unrun_copies(model, trace) if copies is None else copies
    if not copies:
        return {}
    reasons: dict[int, str] = {}
    for gi, g in enumerate(groups):
        modules = {_module_of(p) for p, _ in g.params}
        for ran, idle in copies.items():
            inside = {m for m in modules if m == ran or m.startswith(ran + ".")}
            if inside and inside != modules:
                more = f" (+{len(idle) - 3} more)" if len(idle) > 3 else ""
                listed = ", ".join(idle[:3]) + more
                reasons[gi] = (
                    f"{listed} did not run with the example inputs while {ran}, a copy of "
                    "them, did (a router sent them nothing?): the widths they share with it "
                    "cannot be followed in their weights, so the group is kept whole; give "
                    "example inputs that reach every copy (a larger batch)"
                )
                break
    return reasons
