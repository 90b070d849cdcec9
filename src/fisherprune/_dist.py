"""Whether this process is one of several ranks of ``torch.distributed``."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["in_group"]


def in_group() -> bool:
    """Whether ``torch.distributed`` is initialised with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
