"""Where the data-parallel ranks sit: a `DeviceMesh` with named axes.

[Note: mesh axes]
The data-parallel ranks form a 2-D mesh ``(replicate, shard)``. ZeRO partitions model
states over the ``shard`` axis; ranks along ``replicate`` hold the same shards (hybrid
sharding, FSDP2's HSDP, ZeRO++'s hpZ, all shard within a node and replicate across nodes).
Every flat layout is cut into ``shard`` pieces; gradients are averaged over all of the
``data`` ranks (both axes). Collectives name the axis they run on, and the comm ledger
records bytes by axis, so intra-node and inter-node traffic stay separable. With one
replicate row the DeviceMesh is the 1-D ("shard",) one over the process group (an axis of
one rank needs no process group).

ZeRO++ (hpZ, qgZ) splits a shard axis that spans nodes in two more axes: ``node``, the
ranks of the row on this node, and ``cross_node``, the ranks of the row with this rank's
place on the other nodes (one per node). Shard rank r is (node r // n, place r % n) for n
ranks per node, since torchrun numbers ranks node by node.

Expert parallelism adds ``ep``: [Note: expert-parallel axes]; sequence parallelism ``sp``:
[Note: sequence-parallel axis].
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..config import ConfigError, torchrun_ranks_per_node

__all__ = ["AXES", "Topology"]

# "data" is the whole data-parallel group: both mesh axes together.
AXES = ("shard", "replicate", "data", "node", "cross_node", "tp", "ep", "sp")

# Meshes and zerodp's own process groups already built, by what they were built from, with
# the group they were built over: initialize may run many times in one process, and each
# owns process groups that live until the process group is destroyed.
_MESHES: dict = {}


@dataclass(frozen=True)
class Topology:
    """The data-parallel mesh of this process: axis sizes, this rank's coordinates, and one
    process group per axis (None where there is no process group: a single process)."""

    mesh: Optional[DeviceMesh]
    device: torch.device
    shard_size: int
    shard_rank: int
    replicate_size: int
    replicate_rank: int
    data_group: Optional[dist.ProcessGroup]
    shard_group: Optional[dist.ProcessGroup]
    replicate_group: Optional[dist.ProcessGroup]
    backend: Optional[str]
    timeout_s: Optional[float] = None  # of zerodp's own groups: [Note: no silent hang] in failure.py
    ranks_per_node: Optional[int] = None  # as torchrun says (LOCAL_WORLD_SIZE); None: not known
    # The shard axis split by node (ZeRO++), when built with `node_axes`: see [Note: mesh axes].
    node_group: Optional[dist.ProcessGroup] = None
    cross_node_group: Optional[dist.ProcessGroup] = None
    node_axes: bool = False
    # Tensor parallelism beside the data-parallel mesh: see [Note: tensor-parallel axis].
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Optional[dist.ProcessGroup] = None
    # Expert parallelism inside the data-parallel ranks: see [Note: expert-parallel axes].
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None
    # Sequence parallelism inside the data-parallel ranks: see [Note: sequence-parallel axis].
    sp_size: int = 1
    sp_rank: int = 0
    sp_group: Optional[dist.ProcessGroup] = None

    @property
    def node_size(self) -> int:
        """Ranks of the shard axis on this node (the ``node`` axis)."""
        return min(self.ranks_per_node or self.shard_size, self.shard_size) if self.node_axes else 1

    @property
    def cross_node_size(self) -> int:
        return self.shard_size // self.node_size if self.node_axes else 1

    def crosses_nodes(self, axis: str) -> bool:
        """Whether a group along `axis` holds ranks of more than one node. A row of the mesh
        is consecutive ranks and torchrun numbers ranks node by node ([Note: mesh axes])."""
        node, size, shard = self.ranks_per_node, self.world_size, self.shard_size
        if axis in ("node", "cross_node"):
            return axis == "cross_node" and self.cross_node_size > 1
        if self.tp_size > 1 or axis == "tp":  # nodes are not known over a data-parallel group that skips ranks
            return False
        if axis in ("ep", "sp"):  # consecutive ranks: inside a node when their size divides the ranks per node
            k = self.ep_size if axis == "ep" else self.sp_size
            return node is not None and node < size and (self.rank // k * k) // node != (
                (self.rank // k + 1) * k - 1) // node
        if node is None or node >= size:
            return False
        groups = {"shard": [range(r * shard, (r + 1) * shard) for r in range(self.replicate_size)],
                  "replicate": [range(s, size, shard) for s in range(shard)],
                  "data": [range(size)]}[_axis(axis)]
        return any(len({rank // node for rank in g}) > 1 for g in groups)

    @property
    def name(self) -> str:
        """The same on every rank of the mesh (its data group's name), and another for each
        data-parallel group beside it (one per tensor-parallel rank)."""
        if self.data_group is not None:
            return self.data_group.group_name
        return f"world-tp{self.tp_rank}" if self.tp_size > 1 else "world"

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: replicate x shard."""
        return self.shard_size * self.replicate_size

    @property
    def rank(self) -> int:
        """This process's rank among the data-parallel ranks (replicate-major)."""
        return self.replicate_rank * self.shard_size + self.shard_rank

    @property
    def process_rank(self) -> int:
        """This process's place among every process, data- x tensor-parallel: Megatron's
        order ([Note: tensor-parallel axis]); the data-parallel rank without tensor parallelism."""
        return self.rank * self.tp_size + self.tp_rank

    @property
    def process_count(self) -> int:
        return self.world_size * self.tp_size

    def group(self, axis: str) -> Optional[dist.ProcessGroup]:
        return {"shard": self.shard_group, "replicate": self.replicate_group, "data": self.data_group,
                "node": self.node_group, "cross_node": self.cross_node_group, "tp": self.tp_group,
                "ep": self.ep_group, "sp": self.sp_group}[_axis(axis)]

    def size(self, axis: str) -> int:
        return {"shard": self.shard_size, "replicate": self.replicate_size, "data": self.world_size,
                "node": self.node_size, "cross_node": self.cross_node_size, "tp": self.tp_size,
                "ep": self.ep_size, "sp": self.sp_size}[_axis(axis)]

    def rank_on(self, axis: str) -> int:
        return {"shard": self.shard_rank, "replicate": self.replicate_rank, "data": self.rank,
                "node": self.shard_rank % self.node_size,
                "cross_node": self.shard_rank // self.node_size, "tp": self.tp_rank, "ep": self.ep_rank,
                "sp": self.sp_rank}[_axis(axis)]

    def tensor_parallel_mesh(self) -> DeviceMesh:
        """Every process as a ("tp", ["replicate",] "shard") mesh: the tensor-parallel axis
        outermost, so that a DTensor on it cuts a parameter into tensor-parallel slices first
        and then each slice's rows over the data-parallel ranks, as zerodp holds them ([Note:
        row shards] in sharding/rows.py). Built once; no collective."""
        def build() -> DeviceMesh:
            if self.mesh is None:  # one data-parallel rank
                return DeviceMesh.from_group(self.tp_group, self.device.type, mesh_dim_names=("tp",))
            # Process rank = data rank x tp_size + tp rank; data rank = replicate row x shard_size + shard rank.
            world = self.process_count
            grid = torch.arange(world, dtype=torch.int).view(world // self.tp_size, self.tp_size).t()
            if self.replicate_size > 1:
                grid = grid.reshape(self.tp_size, self.replicate_size, self.shard_size)
                groups, names = [self.tp_group, self.replicate_group, self.shard_group], ("tp", "replicate", "shard")
            else:
                groups, names = [self.tp_group, self.shard_group], ("tp", "shard")
            return DeviceMesh.from_group(groups, self.device.type, mesh=grid.contiguous(), mesh_dim_names=names)

        return _built_once("tp-mesh", (self.tp_group, self.replicate_group if self.replicate_size > 1 else None,
                                       self.shard_group), self.device.type, build)

    def expert_parallel_mesh(self, experts: "Topology") -> DeviceMesh:
        """The data-parallel processes as an ("ep", "shard") mesh, `experts` the
        expert-data-parallel topology (`with_expert_parallel`'s second): the expert-parallel
        axis outermost, so that a DTensor on it cuts a bank by expert first and then each
        rank's experts into rows over the ranks that hold the same experts, as zerodp holds
        them ([Note: row shards] in sharding/rows.py); ("ep",) alone when those ranks are one.
        Built once; no collective."""
        def build() -> DeviceMesh:
            if experts.mesh is None:
                return DeviceMesh.from_group(self.ep_group, self.device.type, mesh_dim_names=("ep",))
            # Data rank = expert-data-parallel rank x ep_size + ep rank ([Note: expert-parallel axes]).
            ranks = torch.tensor(dist.get_process_group_ranks(self.data_group), dtype=torch.int)
            grid = ranks.view(-1, self.ep_size).t().contiguous()
            return DeviceMesh.from_group([self.ep_group, experts.shard_group], self.device.type, mesh=grid,
                                         mesh_dim_names=("ep", "shard"))

        return _built_once("ep-mesh", (self.ep_group, experts.shard_group if experts.mesh is not None else None),
                           self.device.type, build)

    def with_node_axes(self) -> "Topology":
        """This topology with the shard axis split into ``node`` and ``cross_node`` (ZeRO++),
        nodes as torchrun says; each axis of one rank has no process group. Raises
        ConfigError naming the fix if the nodes are unknown or do not tile the shard axis."""
        if self.world_size == 1:
            return dataclasses.replace(self, node_axes=True, ranks_per_node=1)
        if self.ranks_per_node is None:
            ranks_per_node()  # raises, naming what torchrun did not say
            raise ConfigError("Config.hpz / quantize_grads need the default process group (torchrun's ranks)")
        n = min(self.ranks_per_node, self.shard_size)
        if self.replicate_size != 1 or self.shard_size % n:
            raise ConfigError(f"Config.hpz / quantize_grads: the {self.shard_size} ranks of the shard axis are not "
                              f"whole nodes of {self.ranks_per_node} ranks: use a world size that is")
        ranks = dist.get_process_group_ranks(self.shard_group)
        node, place = divmod(self.shard_rank, n)
        node_group = _subgroup(self.shard_group, ranks[node * n: (node + 1) * n], self.timeout_s) if n > 1 else None
        cross = ranks[place::n]
        cross_group = _subgroup(self.shard_group, cross, self.timeout_s) if len(cross) > 1 else None
        return dataclasses.replace(self, node_group=node_group, cross_node_group=cross_group, node_axes=True)

    def with_expert_parallel(self, ep_size: int) -> tuple["Topology", "Topology"]:
        """[Note: expert-parallel axes]
        Expert parallelism splits each expert bank over ``ep``, `ep_size` consecutive
        data-parallel ranks (DeepSpeed-MoE's and torchtitan's layout: inside a node when
        ep_size divides the ranks per node, where the all-to-all is cheapest). The ranks with
        this rank's place in every expert-parallel group hold the same experts: the
        expert-data-parallel ranks, N / ep_size of them, over which ZeRO shards the expert
        parameters as it shards everything else over all N. Returns (this topology with the
        ``ep`` axis, the expert-data-parallel topology: a one-row mesh over those ranks whose
        shard axis is theirs). Raises ConfigError if ep_size does not divide the ranks."""
        world = self.world_size
        if world % ep_size:
            raise ConfigError(f"Config.expert_parallel_size={ep_size} does not divide the {world} data-parallel "
                              f"ranks: use a divisor of {world}")
        if ep_size == 1:
            return self, self
        ranks = dist.get_process_group_ranks(self.data_group)
        me = self.rank
        first = me // ep_size * ep_size
        ep_group = _subgroup(self.data_group, ranks[first: first + ep_size], self.timeout_s)
        edp_ranks = ranks[me % ep_size::ep_size]
        if len(edp_ranks) == 1:  # every expert on one rank of each group: nothing to shard it over
            experts = Topology(None, self.device, 1, 0, 1, 0, None, None, None, self.backend, self.timeout_s)
        else:
            edp_group = _subgroup(self.data_group, edp_ranks, self.timeout_s)
            experts = dataclasses.replace(Topology.build(edp_group, self.device), timeout_s=self.timeout_s)
        return dataclasses.replace(self, ep_size=ep_size, ep_rank=me % ep_size, ep_group=ep_group), experts

    def with_sequence_parallel(self, sp_size: int) -> "Topology":
        """[Note: sequence-parallel axis]
        Sequence parallelism (Ulysses, arXiv 2309.14509) splits each sequence over ``sp``,
        `sp_size` consecutive data-parallel ranks (inside a node when sp_size divides the
        ranks per node: the attention's all-to-alls run on it). The ranks of one group read
        the same batch and hold the same parameters, so ZeRO shards over every rank (sequence
        x data) as without it, and the data-parallel average over all N ranks is right once
        each rank's backward starts from sp_size times its shard's part of the loss
        (sequence_parallel/loss.py). Returns this topology with the ``sp`` axis. Raises
        ConfigError if sp_size does not divide the ranks."""
        world = self.world_size
        if world % sp_size:
            raise ConfigError(f"Config.sequence_parallel_size={sp_size} does not divide the {world} data-parallel "
                              f"ranks: use a divisor of {world}")
        if sp_size == 1:
            return self
        ranks = dist.get_process_group_ranks(self.data_group)
        first = self.rank // sp_size * sp_size
        sp_group = _subgroup(self.data_group, ranks[first: first + sp_size], self.timeout_s)
        return dataclasses.replace(self, sp_size=sp_size, sp_rank=self.rank % sp_size, sp_group=sp_group)

    @classmethod
    def build_tensor_parallel(cls, tp_size: int, device: Optional[torch.device] = None,
                              timeout_s: Optional[float] = None, replicate_size: int = 1) -> "Topology":
        """[Note: tensor-parallel axis]
        The world as data-parallel x tensor-parallel, Megatron's order: a tensor-parallel
        group is `tp_size` consecutive ranks (torchrun numbers ranks node by node, so it
        stays inside a node when tp_size divides the ranks per node), and the data-parallel
        group is the ranks with this rank's place in every tensor-parallel group. The
        data-parallel mesh (and with it ZeRO's shard axis) is built over that group; the
        ``tp`` axis carries the tensor-parallel layers' all-reduces and all-gathers and Pa's
        checkpoint gathers. With `replicate_size` rows the data-parallel ranks are a replicate
        x shard mesh (hybrid sharding), rows of consecutive data-parallel ranks: with
        tp_size dividing the ranks per node, a row of ranks_per_node / tp_size data-parallel
        ranks is one node's. Raises ConfigError if tp_size does not divide the world."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world % tp_size:
            raise ConfigError(f"Config.tensor_parallel_size={tp_size} does not divide the world size {world}: "
                              f"use a divisor of {world}")
        if tp_size == 1:
            return cls.build(None, device, replicate_size, timeout_s=timeout_s)
        me = dist.get_rank()
        data_rank, tp_rank = divmod(me, tp_size)
        tp_ranks = list(range(data_rank * tp_size, (data_rank + 1) * tp_size))
        data_ranks = list(range(tp_rank, world, tp_size))
        world_group = dist.group.WORLD
        tp_group = _subgroup(world_group, tp_ranks, timeout_s)
        data_group = _subgroup(world_group, data_ranks, timeout_s) if len(data_ranks) > 1 else None
        if data_group is None:  # one data-parallel rank: ZeRO shards over nothing
            if replicate_size != 1:
                raise ConfigError(f"Config.replicate_size={replicate_size}: tensor_parallel_size={tp_size} leaves "
                                  f"one data-parallel rank, nothing to replicate over: use replicate_size=1")
            backend = dist.get_backend()
            if device is None:
                device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            base = cls(None, torch.device(device), 1, 0, 1, 0, None, None, None, backend, timeout_s)
        else:
            base = cls.build(data_group, device, replicate_size)
            base = dataclasses.replace(base, timeout_s=timeout_s)
        return dataclasses.replace(base, tp_size=tp_size, tp_rank=tp_rank, tp_group=tp_group)

    @classmethod
    def build(cls, group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None,
              replicate_size: int = 1, timeout_s: Optional[float] = None) -> "Topology":
        """The mesh over `group` (default: every process torchrun started), `replicate_size`
        rows of shard groups. With `timeout_s`, on process groups of zerodp's own that give
        up waiting for a peer after that long. Without a process group (one process) every
        axis has size 1."""
        distributed = dist.is_available() and dist.is_initialized()
        backend = dist.get_backend(group) if distributed else None
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        device = torch.device(device)
        if not distributed:
            if replicate_size != 1:
                raise ConfigError(f"Config.replicate_size={replicate_size} needs that many ranks at least; this is "
                                  f"a single process: use 1")
            return cls(None, device, 1, 0, 1, 0, None, None, None, None)
        world = dist.get_world_size(group)
        if world % replicate_size:
            raise ConfigError(f"Config.replicate_size={replicate_size} does not divide the {world} data-parallel "
                              f"ranks: the mesh is replicate x shard, so use a divisor of {world}")
        base = group if group is not None else dist.group.WORLD
        if timeout_s is not None:
            base = _subgroup(base, dist.get_process_group_ranks(base), float(timeout_s))  # zerodp's timeout
        mesh = _mesh(base, device.type, replicate_size)
        shard_size = world // replicate_size
        node = _known_ranks_per_node() if group is None or group == dist.group.WORLD else None
        if replicate_size == 1:  # a 1-D mesh: an axis of one rank needs no process group
            return cls(mesh, device, shard_size, mesh.get_local_rank("shard"), 1, 0, base, mesh.get_group("shard"),
                       None, backend, timeout_s, node)
        return cls(mesh, device, shard_size, mesh.get_local_rank("shard"), replicate_size,
                   mesh.get_local_rank("replicate"), base, mesh.get_group("shard"), mesh.get_group("replicate"),
                   backend, timeout_s, node)


def ranks_per_node(needed_by: str = "Config.replicate_size='nodes'") -> int:
    """Ranks on each node, as torchrun says: LOCAL_WORLD_SIZE, checked against RANK and
    GROUP_RANK (this node's rank), since a row of the mesh is ranks numbered one after
    another and torchrun numbers them node by node."""
    said = (int(os.environ[k]) if k in os.environ else None for k in ("LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK"))
    return torchrun_ranks_per_node(*said, needed_by)


def _known_ranks_per_node() -> Optional[int]:
    """`ranks_per_node()` where torchrun has said it, else None (the ledger then calls every
    byte intra-node)."""
    try:
        return ranks_per_node()
    except ConfigError:
        return None


def _built_once(kind: str, built_from: tuple, device_type: str, build) -> DeviceMesh:
    """The mesh `build()` makes over the groups `built_from` (None for an axis left out),
    made once per those groups and device type: a group of the same name built anew (a new
    world) makes a new mesh."""
    key = (kind, *(g.group_name if g is not None else None for g in built_from), device_type)
    built = _MESHES.get(key)
    if built is not None and all(a is b for a, b in zip(built[0], built_from)):
        return built[1]
    mesh = build()
    _MESHES[key] = (built_from, mesh)
    return mesh


def _subgroup(parent: dist.ProcessGroup, ranks: list[int], timeout_s: Optional[float]) -> dist.ProcessGroup:
    """A process group over `ranks` (`parent`'s, or a subset with this rank among them),
    built once per parent, ranks and timeout; over a subset only its members create it
    (`use_local_synchronization`), over every process all of them call new_group anyway."""
    key = ("group", parent.group_name, tuple(ranks), timeout_s)
    built = _MESHES.get(key)
    if built is not None and built[0] is parent:
        return built[1]
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    group = dist.new_group(ranks, use_local_synchronization=len(ranks) != dist.get_world_size(), **kwargs)
    _MESHES[key] = (parent, group)
    return group


def _axis(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"mesh axis {axis!r} is unknown: use one of {AXES}")
    return axis


def _mesh(group: dist.ProcessGroup, device_type: str, replicate_size: int) -> DeviceMesh:
    """A (replicate, shard) DeviceMesh over `group`'s ranks, built once per group and size;
    with one replicate row, the 1-D mesh ("shard",) over `group` itself (no new group). Only
    the groups this rank belongs to are created, each by its own members
    (`use_local_synchronization`), so no rank waits on groups it is not in."""
    key = (group.group_name, replicate_size, device_type)
    built = _MESHES.get(key)
    if built is not None and built[0] is group:
        return built[1]
    if replicate_size == 1:
        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))
        _MESHES[key] = (group, mesh)
        return mesh
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    shard_size = len(ranks) // replicate_size
    grid = torch.tensor(ranks, dtype=torch.int).view(replicate_size, shard_size)
    row, col = divmod(ranks.index(me), shard_size)
    shard_group = dist.new_group(grid[row].tolist(), use_local_synchronization=True)
    replicate_group = dist.new_group(grid[:, col].tolist(), use_local_synchronization=True)
    mesh = DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=grid,
                                 mesh_dim_names=("replicate", "shard"))
    _MESHES[key] = (group, mesh)
    return mesh


def forget_meshes() -> None:
    """Drop the built meshes (their process groups are being destroyed)."""
    _MESHES.clear()
