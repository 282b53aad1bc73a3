"""ParallelDims: the degrees, checked against the world size, and the one mesh with its named sub-meshes."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from sana2.config import ConfigError, load_config
from sana2.distributed.parallel_dims import ParallelDims, ParallelDimsError


def test_degrees_resolve_against_the_world_size():
    assert ParallelDims.resolve(1, -1, 4) == ParallelDims(1, 4, 1)
    assert ParallelDims.resolve(2, -1, 4) == ParallelDims(2, 2, 1)
    assert ParallelDims.resolve(1, -1, 8, cp=2) == ParallelDims(1, 4, 2)
    dims = ParallelDims(2, 3, 1)
    assert (dims.world_size, dims.dp_size, dims.hsdp) == (6, 6, True)
    assert (ParallelDims(1, 2, 2).dp_size, ParallelDims(1, 2, 2).hsdp) == (2, False)
    with pytest.raises(
        ParallelDimsError,
        match="context_parallel_degree = 3 x 1 does not divide the world size 4",
    ):
        ParallelDims.resolve(3, -1, 4)
    with pytest.raises(ParallelDimsError, match="= 2 x 3 x 1 must equal the world size 4"):
        ParallelDims.resolve(2, 3, 4)
    with pytest.raises(ParallelDimsError, match="the cp degree must be at least 1"):
        ParallelDims(1, 1, 0)


def test_from_config_names_the_override_and_leaves_the_config_as_it_was():
    config = load_config(None, ["--parallelism.data_parallel_replicate_degree=2", "--training.global_batch_size=8"])
    before = config.to_dict()
    assert ParallelDims.from_config(config, 4) == ParallelDims(2, 2, 1)
    assert config.to_dict() == before
    with pytest.raises(ConfigError, match=r"^command-line override --parallelism.data_parallel_replicate_degree=2: "):
        ParallelDims.from_config(config, 3)


def _check_meshes(rank, world_size, cases, out):
    found = {}
    for degrees in cases:
        dims = ParallelDims(*degrees)
        got = {
            "fsdp": (dims.fsdp_mesh.mesh_dim_names, tuple(dims.fsdp_mesh.shape)),
            "data": (dims.data_mesh.size(), dims.data_mesh.mesh.tolist(), dims.data_rank),
            "data_local": dims.data_mesh.get_local_rank(),
            "cp": dims.cp_mesh.mesh.tolist(),
            "loss": dims.loss_mesh.size(),
        }
        # a reduction over the data mesh sums one value per data rank
        value = torch.tensor([float(dims.data_rank)])
        dist.all_reduce(value, group=dims.data_mesh.get_group())
        got["data_sum"] = value.item()
        assert dims.world_mesh is dims.world_mesh  # built once
        found[degrees] = got
    torch.save(found, out / f"rank{rank}.pt")


# degrees -> what rank 1 of 4 sees
EXPECTED_RANK1 = {
    # FSDP over 4: everything is the world
    (1, 4, 1): {"fsdp": (("dp_shard",), (4,)), "data": (4, [0, 1, 2, 3], 1), "cp": [1], "data_sum": 6.0},
    # HSDP 2 x 2: rank 1 is replica 0, shard 1
    (2, 2, 1): {
        "fsdp": (("dp_replicate", "dp_shard"), (2, 2)),
        "data": (4, [0, 1, 2, 3], 1),
        "cp": [1],
        "data_sum": 6.0,
    },
    # HSDP of one-rank replicas (one GPU per node): fully_shard still gets its 2-D mesh
    (4, 1, 1): {
        "fsdp": (("dp_replicate", "dp_shard"), (4, 1)),
        "data": (4, [0, 1, 2, 3], 1),
        "cp": [1],
        "data_sum": 6.0,
    },
    # 2 data shards x 2 cp ranks: ranks 0 and 1 read the same samples; FSDP shards over all 4
    (1, 2, 2): {"fsdp": (("dp_shard_cp",), (4,)), "data": (2, [1, 3], 0), "cp": [0, 1], "data_sum": 1.0},
    # 2 replicas x 2 cp ranks
    (2, 1, 2): {
        "fsdp": (("dp_replicate", "dp_shard_cp"), (2, 2)),
        "data": (2, [1, 3], 0),
        "cp": [0, 1],
        "data_sum": 1.0,
    },
}


@pytest.mark.slow
def test_the_mesh_and_its_named_sub_meshes_on_four_gloo_ranks(tmp_path):
    run_distributed(_check_meshes, 4, list(EXPECTED_RANK1), tmp_path)
    found = torch.load(tmp_path / "rank1.pt")
    for degrees, expected in EXPECTED_RANK1.items():
        got = found[degrees]
        assert got["data_local"] == got["data"][2], degrees
        assert got["loss"] == 4, degrees
        assert {key: got[key] for key in expected} == expected, degrees
