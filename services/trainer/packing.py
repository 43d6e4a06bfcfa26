"""Shared-prefix packing: the trajectories of a micro-batch as a prefix tree, run as one packed row.

The episodes of a group share their opening token for token, and every episode of a task shares the
system prompt and tool schemas. Run one by one, a group of 8 pays for its ~600-token opening 8 times.
Here the micro-batch's trajectories are arranged in a compressed trie over their *shareable* prefix
(the tokens before the first trained token, which carry no loss and are the same for every episode
that has them); each trie node is one **segment** of the packed token row, computed once, with
gradient, and every descendant attends to its keys/values (``shared.lm``). Each trajectory ends in a
leaf segment that holds the rest of its tokens.

Exact: a token sees the same keys/values at the same positions as in its own unshared forward pass,
so its logprob is the same up to float rounding (tests/trainer/test_packing.py checks 1e-5 against the
plain padded forward). Gradients flow from every leaf into the shared segments within one autograd
graph, so the update is the same too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shared.lm import PackedLM, token_logprobs


@dataclass
class Segment:
    """Rows ``[start, end)`` of the packed row; ``context`` indexes the rows of its ancestors (root
    first) followed by its own, i.e. every key/value row it attends to."""

    start: int
    end: int
    context: torch.Tensor
    num_context: int  # rows of ``context`` that come before the segment (its ancestors)


@dataclass
class PackedBatch:
    """A micro-batch ready for one forward pass. Trained tokens are laid out trajectory by trajectory,
    in the order of ``order`` (indices into the caller's trajectory list)."""

    ids: torch.Tensor  # [N] packed token ids
    positions: torch.Tensor  # [N] position of each row within its own sequence
    segments: list[Segment]
    order: list[int]  # trajectories of this micro-batch, in the layout order of the trained tokens
    predict_rows: torch.Tensor  # [M] the row whose hidden state predicts each trained token
    targets: torch.Tensor  # [M] trained token ids
    trained_per_traj: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return int(self.ids.numel())


def shareable_length(tokens: list[int], trained: list[int]) -> int:
    """Tokens before the first trained one: the part another sequence may share. Keep the last token
    out so that every sequence has a leaf of at least one token."""
    first = next((i for i, m in enumerate(trained) if m), len(tokens))
    return max(0, min(first, len(tokens) - 1))


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    if m == 0:
        return 0
    same = a[:m] == b[:m]
    return m if same.all() else int(same.argmin())


def prefix_order(seqs: list[list[int]], shareable: list[int]) -> list[tuple[int, int]]:
    """Sequences in the lexicographic order of their shareable prefixes (those sharing a prefix become
    neighbours), each with the packed rows it adds after its predecessor: its length less the prefix
    it shares with it. Returns (sequence index, new rows) pairs."""
    order = sorted(range(len(seqs)), key=lambda i: tuple(seqs[i][: shareable[i]]))
    out: list[tuple[int, int]] = []
    prev = None
    for i in order:
        arr = np.asarray(seqs[i][: shareable[i]])
        out.append((i, len(seqs[i]) - (_common_prefix(prev, arr) if prev is not None else 0)))
        prev = arr
    return out


def plan_micro_batches(seqs: list[list[int]], shareable: list[int], max_rows: int) -> list[list[int]]:
    """Order sequences so that those sharing a prefix are neighbours (``prefix_order``) and cut the order
    into micro-batches of at most ``max_rows`` packed rows (one sequence alone may exceed it). Returns
    lists of sequence indices."""
    batches: list[list[int]] = []
    rows = 0
    for i, new_rows in prefix_order(seqs, shareable):
        if batches and rows + new_rows <= max_rows:
            batches[-1].append(i)
            rows += new_rows
        else:
            batches.append([i])
            rows = len(seqs[i])
    return batches


def pack(seqs: list[list[int]], trained: list[list[int]], order: list[int], share: bool = True) -> PackedBatch:
    """Pack the sequences ``order`` (indices into ``seqs``; neighbours should share prefixes, see
    ``plan_micro_batches``) into one prefix tree. ``trained[i][t]`` marks token ``t`` of sequence ``i``
    as trained (scored from the hidden state of token ``t - 1``). ``share=False`` gives every
    sequence its own segment (the unshared computation, for comparison)."""
    cap = {i: shareable_length(seqs[i], trained[i]) if share else 0 for i in order}
    arrays = {i: np.asarray(seqs[i], dtype=np.int64) for i in order}
    segments: list[Segment] = []
    ids: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    rows = 0
    leaf_path: dict[int, list[tuple[int, int]]] = {}  # sequence -> (start row, length) of each segment on its path

    def add_segment(tokens: np.ndarray, depth: int, path: list[tuple[int, int]]) -> list[tuple[int, int]]:
        nonlocal rows
        start = rows
        rows += len(tokens)
        ids.append(tokens)
        positions.append(np.arange(depth, depth + len(tokens)))
        own = path + [(start, len(tokens))]
        context = np.concatenate([np.arange(s, s + n) for s, n in own])
        segments.append(Segment(start, rows, torch.from_numpy(context), int(sum(n for _, n in path))))
        return own

    def build(members: list[int], depth: int, path: list[tuple[int, int]]) -> None:
        """``members`` all share tokens ``[0, depth)`` (the segments of ``path``)."""
        if len(members) > 1:
            common = min(cap[i] for i in members)
            first = arrays[members[0]]
            for i in members[1:]:
                common = min(common, depth + _common_prefix(first[depth:common], arrays[i][depth:common]))
            if common > depth:
                path = add_segment(first[depth:common], depth, path)
                depth = common
        # sequences that cannot share further become leaves; the others split by their next token
        runs: dict[int, list[int]] = {}
        for i in members:
            if len(members) == 1 or cap[i] <= depth:
                leaf_path[i] = add_segment(arrays[i][depth:], depth, path)
            else:
                runs.setdefault(int(arrays[i][depth]), []).append(i)
        for run in runs.values():
            build(run, depth, path)

    build(list(order), 0, [])
    predict_rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    trained_per_traj: list[int] = []
    for i in order:
        row_of = np.concatenate([np.arange(s, s + n) for s, n in leaf_path[i]])  # position -> packed row
        t = np.nonzero(np.asarray(trained[i][1:], dtype=bool))[0] + 1  # trained positions (never 0)
        predict_rows.append(row_of[t - 1])
        targets.append(arrays[i][t])
        trained_per_traj.append(len(t))
    return PackedBatch(ids=torch.from_numpy(np.concatenate(ids)), positions=torch.from_numpy(np.concatenate(positions)),
                       segments=segments, order=list(order),
                       predict_rows=torch.from_numpy(np.concatenate(predict_rows)),
                       targets=torch.from_numpy(np.concatenate(targets)), trained_per_traj=trained_per_traj)


def packed_logprobs(lm: PackedLM, batch: PackedBatch, temperature: torch.Tensor) -> torch.Tensor:
    """Logprobs of the trained tokens of a packed batch (``temperature`` per trained token), with
    gradient when grad mode is on. The LM head runs on the predicting rows only."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = []
        for seg in batch.segments:
            out.append(lm.attention(q[seg.start: seg.end], k.index_select(0, seg.context),
                                    v.index_select(0, seg.context), seg.num_context))
        return torch.cat(out)

    hidden = lm.hidden(batch.ids, batch.positions, attend)
    return token_logprobs(lm.logits(hidden.index_select(0, batch.predict_rows)), batch.targets, temperature)
