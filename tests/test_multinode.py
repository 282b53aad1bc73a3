"""Multi-node launch: two torchrun "nodes" on this machine through run_train.sh (NNODES=2, c10d rendezvous on
127.0.0.1, one process each), with FSDP across the nodes and with HSDP replicating across them. A run stopped
at step 2 and resumed ends with a checkpoint bit-identical to an uninterrupted run's."""

import os
import subprocess
from pathlib import Path

import pytest
from dist_utils import free_port
from test_checkpoint import assert_same, checkpoint_contents
from train_utils import TINY

from sana2.config import load_config
from sana2.data.digits import build_digits_dataset

ROOT = Path(__file__).resolve().parents[1]
# run_train.sh's default config (the debug one, EMA on) with the tiny model; a constant lr, so that a run
# of 2 steps and one of 4 follow the same schedule
RUN = [
    *TINY,
    "--checkpoint.enable=true",
    "--checkpoint.interval=1000",
    "--training.global_batch_size=16",
    "--lr_scheduler.decay_type=constant",
]


def launch_two_nodes(dump: Path, *overrides: str) -> list[str]:
    """run_train.sh once per "node", both at once, joined by torchrun's c10d rendezvous; returns their output."""
    port = free_port()
    env = {
        **os.environ,
        "NNODES": "2",
        "NGPU": "1",
        "RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "RDZV_ID": f"sana2-test-{port}",
        "OMP_NUM_THREADS": "1",
    }
    command = [str(ROOT / "run_train.sh"), *RUN, f"--job.dump_folder={dump}", *overrides]
    nodes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300)[0])
    finally:
        for node in nodes:
            if node.poll() is None:  # a failed rendezvous must not leave a node waiting
                node.kill()
    for index, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {index} failed:\n{output[-3000:]}"
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize(
    "sharding", [[], ["--parallelism.data_parallel_replicate_degree=2"]], ids=["FSDP across nodes", "HSDP"]
)
def test_two_nodes_train_checkpoint_and_resume_exactly(tmp_path, sharding):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    # build the digits cache the runs read (<dump folder>/../data/digits) first, here: building it draws from
    # rank 0's Python RNG, which would make the first run's saved RNG state differ from runs that find the cache
    config = load_config(ROOT / "train_configs/debug_model.toml", RUN)  # what run_train.sh trains
    build_digits_dataset(tmp_path / "data" / "digits", config.encoding.text_encoder, config.caption_length)
    launch_two_nodes(straight, "--training.steps=4", *sharding)
    launch_two_nodes(stopped, "--training.steps=2", *sharding)
    resumed = launch_two_nodes(stopped, "--training.steps=4", *sharding)

    assert any(f"resumed from {stopped / 'checkpoint' / 'step-2'} at step 2" in out for out in resumed)
    final = straight / "checkpoint" / "step-4"
    assert sorted(p.name for p in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # two ranks wrote
    expected = checkpoint_contents(final, straight)
    actual = checkpoint_contents(stopped / "checkpoint" / "step-4", stopped)
    assert_same(actual, expected, "step-4 checkpoint")  # model, optimizer, data position, every rank's RNG
