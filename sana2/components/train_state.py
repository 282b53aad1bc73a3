"""The trainer's state as Stateful objects, which the checkpoint manager saves and restores.

TrainState   the step, the epoch and the count of skipped (non-finite) steps
RNGState     this rank's global random generators (Python, NumPy, torch, CUDA)
ModelState, OptimizerState
             the sharded model and optimizer, through DCP's state-dict helpers (parameter names
             as keys, so a checkpoint loads at any world size)
The data loader, the lr scheduler and the EMA are Stateful themselves.
"""

import dataclasses
import random

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from sana2.components.checkpoint import PerRankStateful
from sana2.components.model_transforms import frozen_parameter_names
from sana2.log import logger
from sana2.seeding import derive_seed


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


@dataclasses.dataclass
class TrainState(Stateful):
    step: int = 0  # optimizer steps done
    epoch: int = 0  # the data loader's epoch (its own state restores it; kept here for exports)
    skipped_steps: int = 0
    consecutive_nonfinite: int = 0

    def count_step(self, step: int, loss: float, grad_norm: float, limit: int) -> bool:
        """Record whether step `step` was finite; returns whether its update may be applied.

        Raises NonFiniteError when `limit` steps in a row were not: the run is diverging or its
        data is broken, and skipping more would only hide it.
        """
        if np.isfinite(loss) and np.isfinite(grad_norm):
            self.consecutive_nonfinite = 0
            return True
        self.skipped_steps += 1
        self.consecutive_nonfinite += 1
        logger.warning(
            f"step {step}: non-finite loss {loss} or grad norm {grad_norm}; update skipped "
            f"({self.consecutive_nonfinite} in a row)"
        )
        if self.consecutive_nonfinite >= limit:
            raise NonFiniteError(
                f"{self.consecutive_nonfinite} consecutive steps had a non-finite loss or "
                f"gradient norm (training.max_consecutive_nonfinite = {limit}); stopping"
            )
        return False

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name, value in state.items():
            setattr(self, name, int(value))


def capture_rng() -> dict:
    """This process's global random generators."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState(PerRankStateful):
    """Each rank's global generators, saved under "rank<r>".

    Training draws its randomness from generators seeded per sample (sana2/seeding.py), so these
    streams only serve code that uses the global generators; they are seeded per rank at start
    and restored exactly on resume. A rank the checkpoint has no entry for (a resume at a larger
    world size) is seeded as at start.
    """

    def __init__(self, rank: int, seed: int):
        self.rank, self.seed = rank, seed
        self.reseed()

    def reseed(self) -> None:
        rank_seed = derive_seed("rng", self.seed, self.rank)
        random.seed(rank_seed)
        np.random.seed(rank_seed % 2**32)  # NumPy takes 32-bit seeds
        torch.manual_seed(rank_seed)  # also seeds every CUDA device

    def state_dict(self) -> dict:
        return {f"rank{self.rank}": capture_rng()}

    def load_state_dict(self, state: dict) -> None:
        if f"rank{self.rank}" in state:
            restore_rng(state[f"rank{self.rank}"])
        else:
            self.reseed()


TRAINED = StateDictOptions(ignore_frozen_params=True)
# the keys DCP loaded are the saved state's own (its load checked them); frozen parameters are not among them
TRAINED_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)


class ModelState(Stateful):
    """The model's trainable parameters and its buffers. Frozen parameters (sana2/components/model_transforms.py)
    are left out: they come from the initial weights on every start."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        # the sharded parameters themselves: DCP loads in place
        return get_model_state_dict(self.model, options=StateDictOptions(ignore_frozen_params=True))

    def load_state_dict(self, state: dict) -> None:
        frozen = set(frozen_parameter_names(self.model))
        result = set_model_state_dict(self.model, state, options=StateDictOptions(strict=not frozen))
        if frozen and (set(result.missing_keys) - frozen or result.unexpected_keys):
            raise RuntimeError(
                f"the checkpoint's model state does not match the model: missing "
                f"{sorted(set(result.missing_keys) - frozen)}, unexpected {sorted(result.unexpected_keys)}"
            )


class OptimizerState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)  # keyed by parameter name

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)
