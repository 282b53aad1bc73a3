"""The trainer's Stateful pieces: counters, per-rank RNG across world sizes, the checkpoint manager's
state_dict/load_state_dict protocol."""

import random

import numpy as np
import pytest
import torch
from dist_utils import run_distributed

from sana2.components.checkpoint import CheckpointManager
from sana2.components.train_state import NonFiniteError, RNGState, TrainState, capture_rng

SEED = 5


def test_train_state_counts_skipped_steps_and_stops_at_the_limit():
    state = TrainState()
    assert state.count_step(1, 0.5, 1.0, limit=2)
    assert not state.count_step(2, float("nan"), 1.0, limit=2)
    assert state.count_step(3, 0.4, 1.0, limit=2)  # a finite step resets the run of non-finite ones
    assert not state.count_step(4, 0.4, float("inf"), limit=2)
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps .*training.max_consecutive_nonfinite = 2"):
        state.count_step(5, float("nan"), float("nan"), limit=2)
    assert (state.skipped_steps, state.consecutive_nonfinite) == (3, 2)
    restored = TrainState()
    restored.load_state_dict(state.state_dict())
    assert restored == state


def _save_rng_at_two_ranks(rank, world_size, folder, out_dir):
    rng = RNGState(rank, SEED)
    for _ in range(rank + 1):  # each rank moves its generators its own way
        torch.rand(3), random.random(), np.random.rand()
    train_state = TrainState(step=4)
    CheckpointManager(folder, 1, 0, "disabled", rank, states={"train_state": train_state, "rng": rng}).save(4)
    torch.save(capture_rng(), out_dir / f"saved{rank}.pt")
    torch.rand(5)  # moved on after the save: the load must bring back the saved state


def _load_rng_at_four_ranks(rank, world_size, folder, out_dir):
    rng = RNGState(rank, SEED)
    torch.save(capture_rng(), out_dir / f"fresh{rank}.pt")
    torch.rand(7)
    train_state = TrainState()
    manager = CheckpointManager(folder, 1, 0, "disabled", rank, states={"train_state": train_state, "rng": rng})
    assert manager.resume("latest") == folder / "step-4"
    assert train_state.step == 4
    torch.save(capture_rng(), out_dir / f"loaded{rank}.pt")


@pytest.mark.slow
def test_rng_resumes_per_rank_and_ranks_new_to_a_larger_world_keep_their_own_seeding(tmp_path):
    folder = tmp_path / "checkpoint"
    run_distributed(_save_rng_at_two_ranks, 2, folder, tmp_path)
    run_distributed(_load_rng_at_four_ranks, 4, folder, tmp_path)
    load = {name: torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("saved0", "saved1")}
    for rank in range(4):
        loaded = torch.load(tmp_path / f"loaded{rank}.pt", weights_only=False)
        fresh = torch.load(tmp_path / f"fresh{rank}.pt", weights_only=False)
        expected = load[f"saved{rank}"] if rank < 2 else fresh  # ranks 2 and 3 had nothing saved: seeded as at start
        assert torch.equal(loaded["torch"], expected["torch"]), rank
        assert loaded["python"] == expected["python"], rank
        assert all(np.array_equal(a, b) for a, b in zip(loaded["numpy"], expected["numpy"])), rank
    fresh = [torch.load(tmp_path / f"fresh{rank}.pt", weights_only=False)["torch"] for rank in range(4)]
    assert len({bytes(state.numpy()) for state in fresh}) == 4  # every rank its own stream
