"""The degrees of parallelism, and the device mesh built once from them with its named sub-meshes.

    world = dp_replicate x dp_shard x cp          ranks laid out in that order, cp varying fastest

  dp_replicate  HSDP's replicas: whole copies of the sharded model (1: plain FSDP)
  dp_shard      the ranks a parameter is sharded over within one replica
  cp            context parallelism: the ranks one sample's tokens are split over

Sub-meshes, each by its name:
  fsdp_mesh   what fully_shard shards over: 1-D ("dp_shard_cp",), or 2-D ("dp_replicate", "dp_shard_cp")
              for HSDP. The cp ranks of a sample shard its parameters too, as in torchtitan.
  data_mesh   ("dp",): what the data is split over, dp_replicate x dp_shard ranks; the ranks of one cp
              group read the same samples. The data rank and size are its coordinate and size.
  cp_mesh     ("cp",): the ranks one sample's tokens are split over.
  loss_mesh   every rank ("dp_cp",): a global mean loss sums every rank's token losses.

sana2 writes this class instead of using torchtitan's ParallelDims: that one fixes the device type to
cuda even on CPU machines and builds its flattened meshes with the private DeviceMesh._unflatten, which
gloo and the memory plan's fake backend would rely on. Here a flattened sub-mesh is a slice of the world
mesh when one dimension spans it, else a mesh over process groups made with the public
`new_subgroups_by_enumeration` and `DeviceMesh.from_group`.
"""

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

WORLD_DIMS = ("dp_replicate", "dp_shard", "cp")


class ParallelDimsError(ValueError):
    """Degrees that do not fit the world size; the message names the parallelism keys."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int = 1
    device_type: str = field(default="cpu", compare=False)

    def __post_init__(self):
        for name in WORLD_DIMS:
            if getattr(self, name) < 1:
                raise ParallelDimsError(f"the {name} degree must be at least 1, got {getattr(self, name)}")

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, world_size: int, cp: int = 1, device_type: str = "cpu"):
        """The degrees for `world_size` ranks; dp_shard = -1 takes the ranks the others leave."""
        if dp_shard == -1:
            if world_size % (dp_replicate * cp):
                raise ParallelDimsError(
                    f"parallelism.data_parallel_replicate_degree x parallelism.context_parallel_degree = "
                    f"{dp_replicate} x {cp} does not divide the world size {world_size}"
                )
            dp_shard = world_size // (dp_replicate * cp)
        if dp_shard <= 0 or dp_replicate * dp_shard * cp != world_size:
            raise ParallelDimsError(
                f"parallelism.data_parallel_replicate_degree x parallelism.data_parallel_shard_degree x "
                f"parallelism.context_parallel_degree = {dp_replicate} x {dp_shard} x {cp} must equal the world "
                f"size {world_size}"
            )
        return cls(dp_replicate, dp_shard, cp, device_type)

    @classmethod
    def from_config(cls, config, world_size: int, device_type: str = "cpu") -> "ParallelDims":
        """From config.parallelism; a ConfigError led by where the values came from if they do not fit."""
        p = config.parallelism
        try:
            return cls.resolve(
                p.data_parallel_replicate_degree,
                p.data_parallel_shard_degree,
                world_size,
                cp=p.context_parallel_degree,
                device_type=device_type,
            )
        except ParallelDimsError as exc:
            raise config.error(str(exc)) from None

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def dp_size(self) -> int:
        """Ranks the data is split over."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    # -- the mesh: built on first use, once, by every rank -------------------------------------------
    @cached_property
    def world_mesh(self) -> DeviceMesh:
        """The one mesh (a collective to build: every rank builds it). Only degrees above 1 are dimensions,
        and dp_shard: HSDP's fully_shard needs its 2-D (replicate, shard) mesh even when a replica is one rank."""
        dims = [(n, getattr(self, n)) for n in WORLD_DIMS if getattr(self, n) > 1 or (n == "dp_shard" and self.hsdp)]
        dims = dims or [("dp_shard", 1)]
        names, sizes = zip(*dims)
        if math.prod(sizes) != dist.get_world_size():
            raise ParallelDimsError(f"degrees {dict(dims)} do not match the process group's {dist.get_world_size()}")
        return init_device_mesh(self.device_type, tuple(sizes), mesh_dim_names=tuple(names))

    @cached_property
    def fsdp_mesh(self) -> DeviceMesh:
        shard_cp = self._flattened(("dp_shard", "cp"), "dp_shard_cp")
        if not self.hsdp:
            return shard_cp
        if self.cp == 1:
            return self.world_mesh["dp_replicate", "dp_shard"]
        replicate = self._flattened(("dp_replicate",), "dp_replicate")
        layout = self.world_mesh.mesh.reshape(self.dp_replicate, self.dp_shard * self.cp)
        return DeviceMesh.from_group(
            [replicate.get_group(), shard_cp.get_group()],
            self.device_type,
            mesh=layout,
            mesh_dim_names=("dp_replicate", "dp_shard_cp"),
        )

    @cached_property
    def data_mesh(self) -> DeviceMesh:
        return self._flattened(("dp_replicate", "dp_shard"), "dp")

    @cached_property
    def cp_mesh(self) -> DeviceMesh:
        return self._flattened(("cp",), "cp")

    @cached_property
    def loss_mesh(self) -> DeviceMesh:
        return self._flattened(WORLD_DIMS, "dp_cp")

    @property
    def rank(self) -> int:
        """This rank's place in the world (0 with no process group: a world of one)."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel ranks (its coordinate, no collective)."""
        r, s, _ = self._coordinate()
        return r * self.dp_shard + s

    def _coordinate(self) -> tuple[int, int, int]:
        rank = self.rank
        return rank // (self.dp_shard * self.cp), rank // self.cp % self.dp_shard, rank % self.cp

    def _flattened(self, dims: tuple[str, ...], name: str) -> DeviceMesh:
        """The 1-D mesh over the ranks that differ only in `dims` (this rank's group of them)."""
        spanning = [d for d in dims if getattr(self, d) > 1]
        present = self.world_mesh.mesh_dim_names
        if len(spanning) == 1 or (not spanning and dims[0] in present):
            return self.world_mesh[spanning[0] if spanning else dims[0]]
        if math.prod(getattr(self, d) for d in dims) == self.world_size:  # every rank: the default group
            return DeviceMesh.from_group(dist.group.WORLD, self.device_type, mesh_dim_names=(name,))
        # ranks as a [dp_replicate, dp_shard, cp] grid: the groups are its slices along `dims`
        grid = self.world_mesh.mesh.reshape(self.dp_replicate, self.dp_shard, self.cp)
        axes = [WORLD_DIMS.index(d) for d in dims]
        others = [a for a in range(3) if a not in axes]
        groups = grid.permute(*others, *axes).reshape(-1, math.prod(getattr(self, d) for d in dims))
        group, _ = dist.new_subgroups_by_enumeration(groups.tolist())
        mine = next(row for row in groups if dist.get_rank() in row.tolist())
        return DeviceMesh.from_group(group, self.device_type, mesh=mine, mesh_dim_names=(name,))
