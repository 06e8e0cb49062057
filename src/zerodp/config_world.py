"""The Config against the world it runs in: the checks that need the process group, torchrun's
nodes, the device or the model, all here, in one pure function.

`Config.__post_init__` refuses what is wrong whatever the world; `check_world` refuses what
this world cannot run, and turns replicate_size="nodes" into a number. `zerodp.initialize`
gathers the `WorldFacts` on every rank and calls it once; every rank sees the same facts
(apart from torchrun's RANK), so every rank raises the same error, carried through the
ranks' agreement as any other of initialize's errors.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from .config import Config, ConfigError, torchrun_ranks_per_node

__all__ = ["WorldFacts", "check_world", "ranks_per_node"]

# Devices whose random generators tensor parallelism's split-region streams know
# ([Note: tensor-parallel random streams] in tensor_parallel/rng.py).
TENSOR_PARALLEL_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class WorldFacts:
    world_size: int = 1
    """Ranks of the process group zerodp runs over; 1 for a single process."""

    default_group: bool = True
    """That group is the default one (torchrun's ranks), not a process_group of the caller's."""

    local_world_size: Optional[int] = None
    """torchrun's LOCAL_WORLD_SIZE (ranks on each node); None where it is not set."""

    rank: Optional[int] = None
    """torchrun's RANK; None where it is not set."""

    node_rank: Optional[int] = None
    """torchrun's GROUP_RANK (this node's rank); None where it is not set."""

    device_type: str = "cpu"
    """Type of the device the model trains on ("cpu", "cuda", ...)."""

    model_on_meta: bool = False
    """The model's parameters are on the meta device (built under zerodp.init)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ, **facts) -> "WorldFacts":
        """These facts with torchrun's variables read from `environ`."""
        def read(key: str) -> Optional[int]:
            return int(environ[key]) if key in environ else None

        return cls(local_world_size=read("LOCAL_WORLD_SIZE"), rank=read("RANK"), node_rank=read("GROUP_RANK"),
                   **facts)


def ranks_per_node(world: WorldFacts, needed_by: str = "Config.replicate_size='nodes'") -> int:
    """Ranks on each node, as torchrun told `world`; raises ConfigError naming `needed_by`."""
    return torchrun_ranks_per_node(world.local_world_size, world.rank, world.node_rank, needed_by)


def check_world(config: Config, world: WorldFacts) -> Config:
    """`config` as it runs in `world`: replicate_size="nodes" resolved to the number of nodes.
    Raises ConfigError, naming the field and the fix, for what this world cannot run."""
    tp, size = config.tensor_parallel_size, world.world_size
    nodes_wanted = config.hpz or config.quantize_grads is not None
    if not world.default_group:
        if tp > 1:
            raise ConfigError(f"Config.tensor_parallel_size={tp} splits every process into data- and "
                              f"tensor-parallel groups itself: pass no process_group")
        if config.replicate_size == "nodes":
            raise ConfigError("Config.replicate_size='nodes' needs the default process group (torchrun's ranks); "
                              "with a process_group of your own, give the number of rows")
        if nodes_wanted and size > 1:
            raise ConfigError("Config.hpz / quantize_grads split the ranks by node, as torchrun numbers them: they "
                              "need the default process group; pass no process_group, or leave them off")
    if tp > 1:
        # Stages 0-2 materialise a zerodp.init model whole before the split; stage 3 gives
        # each unit real storage only as it shards it, after the split would have needed it.
        if world.model_on_meta and config.stage == 3:
            raise ConfigError(f"Config.tensor_parallel_size={tp} at stage 3: the model is on the meta device "
                              f"(built under zerodp.init), and stage 3 materialises each unit as it shards it, "
                              f"after tensor parallelism must cut the whole weights: build the model normally, "
                              f"or use stage 0-2 (which materialise it whole first)")
        if size % tp:
            raise ConfigError(f"Config.tensor_parallel_size={tp} does not divide the world size {size}: use a "
                              f"divisor of {size}")
        if world.device_type not in TENSOR_PARALLEL_DEVICES:
            raise ConfigError(f"Config.tensor_parallel_size={tp} on a {world.device_type} device: tensor "
                              f"parallelism's dropout streams are built for {' and '.join(TENSOR_PARALLEL_DEVICES)} "
                              f"devices: use tensor_parallel_size=1")
    if config.offload_optimizer == "disk" and world.device_type != "cpu":
        raise ConfigError(f"Config.offload_optimizer='disk' runs on CPU only so far; the parameters are on "
                          f"{world.device_type}: use offload_optimizer='host' there")
    if nodes_wanted and size > 1:
        local = ranks_per_node(world, "Config.hpz / quantize_grads")
        if size % local:
            raise ConfigError(f"Config.hpz / quantize_grads split the ranks by node: {size} ranks are not whole "
                              f"nodes of {local}: use a world size that is")
    if config.replicate_size == "nodes":
        if size == 1:
            return dataclasses.replace(config, replicate_size=1)
        local = ranks_per_node(world)
        if size % local:
            raise ConfigError(f"Config.replicate_size='nodes': {size} ranks are not whole nodes of {local}")
        return dataclasses.replace(config, replicate_size=size // local)
    data = size // tp  # the data-parallel ranks the mesh is built over ([Note: tensor-parallel axis])
    if size == 1 and config.replicate_size != 1:
        raise ConfigError(f"Config.replicate_size={config.replicate_size} needs that many ranks at least; this is "
                          f"a single process: use 1")
    if data % config.replicate_size:
        raise ConfigError(f"Config.replicate_size={config.replicate_size} does not divide the {data} data-parallel "
                          f"ranks: the mesh is replicate x shard, so use a divisor of {data}")
    return config
