"""Recovery of a pruned model past one device: distillation from the dense model under
``torchrun`` with FSDP2 (``fully_shard``), sharded checkpoints with
``torch.distributed.checkpoint``, resume after ``kill -9``, and the result written whole.
Models may be read on rank 0 only, the other ranks building theirs on the meta device
(``fisherprune.recover.rank0``).

    distill_sharded           train the shrunk student on the dense teacher, sharded
    save_pretrained_gathered  the trained student as a plain Hugging Face folder
    full_state_dict           its weights whole on rank 0
    ShardedCheckpoints        the checkpoint folders (written whole, verified on loading)
"""

from fisherprune.recover.checkpoints import Position, ShardedCheckpoints
from fisherprune.recover.gather import full_state_dict, save_pretrained_gathered
from fisherprune.recover.loop import Recovery, distill_sharded
from fisherprune.recover.sharding import find_blocks, shard_model

__all__ = [
    "Position",
    "Recovery",
    "ShardedCheckpoints",
    "distill_sharded",
    "find_blocks",
    "full_state_dict",
    "save_pretrained_gathered",
    "shard_model",
]
