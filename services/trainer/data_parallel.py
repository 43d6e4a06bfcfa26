"""Data parallelism for the trainer: how rank 0 splits one step's batch over the ranks.

The update must be the one a single rank would make on the whole batch, so only what is per token is
split, and everything that is a statistic of the batch is a sum that the ranks all-reduce:

* rank 0 keeps what needs whole groups: the staleness filter and the GRPO group advantages (one number
  per trajectory), and the minibatch each trajectory belongs to (from the micro-batch plan of the whole
  batch, as on one rank), then cuts each minibatch's trajectories, in prefix order, into one run per rank
  of about equal packed tokens (``split_contiguous``): a trajectory is never cut, and a group (which shares
  its opening) stays on one rank unless a cut falls inside it;
* every rank turns its share into token advantages and normalises them per task with the whole batch's
  sums (``rl.task_norm_sums``, all-reduced), and divides its loss by the whole minibatch's trained-token
  count (all-reduced), so the gradients the ranks add up are the single-rank gradient;
* every rank runs the same number of forward/backward passes per minibatch (ZeRO's collectives run inside
  them): a rank with fewer micro-batches, or none, runs zero-weight padding passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import Trajectory


@dataclass
class ShareItem:
    """One trajectory of a share and what rank 0 decided for it."""

    traj: Trajectory
    advantage: float = 0.0  # GRPO advantage of the trajectory (its group's reward statistics)
    weight: float = 1.0  # staleness weight of its tokens
    minibatch: int = 0  # the optimizer step (minibatch) it is in


@dataclass
class RankShare:
    """What one rank trains on in one step (rank 0 scatters one to each rank)."""

    mode: str  # "rl": train on the share | "sft": this rank's demonstrations | "idle": nothing to step
    step: int  # the trainer's step counters, which the lr schedule and the staleness bound read
    policy_version: int
    items: list[ShareItem] = field(default_factory=list)
    num_minibatches: int = 0  # of the whole batch: every rank steps this many times
    tasks: list[str] = field(default_factory=list)  # every task of the whole batch, one order on every rank
    checkpoint: str = ""  # ZeRO shards go here after the step (every rank writes its own), or no checkpoint

    @property
    def trajs(self) -> list[Trajectory]:
        return [item.traj for item in self.items]


def split_contiguous(costs: list[int], world: int) -> list[list[int]]:
    """Positions ``0..len(costs)-1`` of a sequence cut into ``world`` contiguous runs of about equal cost
    (an item goes to the next rank when more than half of it would pass this rank's even share). Given
    trajectories in prefix order with the packed rows each adds (``packing.prefix_order``), a group's
    episodes, which share their opening, stay together unless a cut falls inside the group, so the
    opening runs once on one rank rather than once on every rank. A rank may get nothing."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    total = sum(costs)
    shares: list[list[int]] = [[] for _ in range(world)]
    rank, done = 0, 0.0
    for pos, cost in enumerate(costs):
        while rank < world - 1 and done + cost / 2 > total * (rank + 1) / world:
            rank += 1
        shares[rank].append(pos)
        done += cost
    return shares
