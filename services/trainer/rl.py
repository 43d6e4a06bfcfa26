"""The RL math, in data-flow order: group advantages -> task normalisation -> importance weights -> loss.

* GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath): ``A_i = (r_i - mean_g) / (std_g + eps)``
  over the episodes of one group (same task instance). Population std; a group whose rewards are all
  equal carries no signal and gets zeros.
* Task advantage normalisation (AgentRL, Zhang et al. 2025, Sec. 3.3): token-level advantages are
  normalised within each task's share of the batch, so that tasks with long trajectories or easy
  rewards do not dominate the gradient. The paper's zero mean / unit variance is one mode; the default
  scales without re-centring, so groups without signal stay at zero (``task_normalize``).
* PPO-clip (Schulman et al. 2017) with token-level aggregation (DAPO): the loss is summed over every
  trained token of the batch and divided by their count, not averaged per sequence first.
* Decoupled PPO (Hilton et al. 2022; AReaL): clip against a *proximal* policy and correct for the
  behaviour policy with a truncated importance weight, for off-policy (stale, cross-policy) turns.
  Dual-clip (Ye et al. 2020) bounds the loss of negative-advantage tokens with huge ratios.

Left out on purpose: value functions and GAE (outcome rewards, GRPO-style), entropy bonus, length
penalties. KL to a reference model is ``kl_k3`` below, applied by the trainer only when enabled.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, group_ids: list[str], normalize_std: bool = True) -> torch.Tensor:
    """Per-trajectory GRPO advantages. ``rewards[i]`` belongs to group ``group_ids[i]``."""
    if rewards.numel() != len(group_ids):
        raise ValueError(f"{rewards.numel()} rewards for {len(group_ids)} group ids")
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for gid in dict.fromkeys(group_ids):
        idx = torch.tensor([i for i, g in enumerate(group_ids) if g == gid])
        r = rewards[idx].float()
        centred = r - r.mean()
        if normalize_std:
            std = r.std(unbiased=False)
            centred = centred / (std + EPS) if std > EPS else torch.zeros_like(centred)
        adv[idx] = centred
    return adv


def task_normalize(token_adv: torch.Tensor, token_task: list[str] | torch.Tensor, mode: str = "paper") -> torch.Tensor:
    """Normalise token-level advantages within each task.

    ``token_adv`` holds one value per *trained* token of the batch; ``token_task`` names its task
    (a list of names, or integer task codes). Modes:

    * ``paper`` (AgentRL): zero mean, unit variance over every token of the task. When episode length
      correlates with reward, re-centring gives the tokens of all-fail groups (advantage 0, no signal)
      a non-zero advantage, and can flip the sign of others.
    * ``scale``: divide each task's tokens by their root mean square, computed over the tokens that
      carry signal (non-zero advantage). Nothing is re-centred: a zero stays zero, no sign changes.
    * ``off``: unchanged.

    A task whose advantages are all equal gets zeros (``paper``) or stays as it is (``scale``: zeros).
    Computed from per-task sums (``task_norm_sums``), so that data-parallel ranks holding parts of one
    batch can add their sums up (all-reduce) and normalise their part exactly as the whole batch.
    """
    codes = _codes(token_adv, token_task)
    num_tasks = int(codes.max()) + 1 if codes.numel() else 0
    return task_normalize_with(token_adv, codes, task_norm_sums(token_adv, codes, num_tasks), mode)


def task_norm_sums(token_adv: torch.Tensor, codes: torch.Tensor, num_tasks: int) -> torch.Tensor:
    """Per task (row = task code): token count, sum, sum of squares, count of non-zero (signal) tokens,
    in float64. Sums over disjoint parts of a batch add up to the whole batch's."""
    a = token_adv.double()
    out = torch.zeros(num_tasks, 4, dtype=torch.float64)
    out[:, 0].index_add_(0, codes, torch.ones_like(a))
    out[:, 1].index_add_(0, codes, a)
    out[:, 2].index_add_(0, codes, a * a)
    out[:, 3].index_add_(0, codes, (a != 0).double())
    return out


def task_normalize_with(token_adv: torch.Tensor, codes: torch.Tensor, sums: torch.Tensor, mode: str) -> torch.Tensor:
    """``task_normalize`` of some tokens of a batch, given the whole batch's ``task_norm_sums``."""
    if mode == "off":
        return token_adv.float()
    if mode not in ("paper", "scale"):
        raise ValueError(f"unknown task normalisation {mode!r}")
    count, total, squares, signal = sums.unbind(1)
    if mode == "scale":  # RMS over the signal tokens (the zeros add nothing to the sum of squares)
        centre = torch.zeros_like(total)
        spread = (squares / signal.clamp(min=1)).sqrt()
    else:  # population mean and std over every token of the task
        centre = total / count.clamp(min=1)
        spread = (squares / count.clamp(min=1) - centre * centre).clamp(min=0).sqrt()
    scale = torch.where(spread > EPS, 1.0 / spread.clamp(min=EPS), torch.zeros_like(spread))
    return ((token_adv.double() - centre[codes]) * scale[codes]).float()


def _codes(token_adv: torch.Tensor, token_task: list[str] | torch.Tensor) -> torch.Tensor:
    if isinstance(token_task, torch.Tensor):
        codes = token_task.long()
    else:
        names = {name: i for i, name in enumerate(dict.fromkeys(token_task))}
        codes = torch.tensor([names[t] for t in token_task], dtype=torch.long)
    if codes.numel() != token_adv.numel():
        raise ValueError(f"{token_adv.numel()} advantages for {codes.numel()} task labels")
    return codes


def staleness_weights(staleness: list[int], tasks: list[str], bounds: dict[str, int], mode: str = "drop",
                      downweight: float = 0.5) -> list[float]:
    """Per-trajectory weight from how many versions its oldest turn lags the trainer.

    ``bounds`` maps task -> largest allowed lag (``"*"`` for every task without its own bound). Within
    the bound: 1. Beyond it: 0 in ``drop`` mode, ``downweight`` in ``downweight`` mode.
    """
    if mode not in ("drop", "downweight"):
        raise ValueError(f"unknown staleness mode {mode!r}")
    out = []
    for lag, task in zip(staleness, tasks, strict=True):
        bound = bounds.get(task, bounds.get("*"))
        if bound is None or lag <= bound:
            out.append(1.0)
        else:
            out.append(0.0 if mode == "drop" else downweight)
    return out


def truncated_is_weight(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(pi_prox / pi_behav, cap)`` per token, without gradient (decoupled PPO's correction)."""
    return torch.exp(proximal_logp - behaviour_logp).clamp(max=cap).detach()


def ppo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_eps: float,
                   dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss and a 0/1 tensor marking clipped tokens.

    ``loss = max(-A r, -A clip(r, 1-eps, 1+eps))`` with ``r = exp(logp - old_logp)``; with dual-clip
    ``c`` the loss of a token with ``A < 0`` is at most ``-A c``.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    was_clipped = (clipped > unclipped).float()
    return loss, was_clipped


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                num_tokens: int, clip_eps: float = 0.2, proximal_logp: torch.Tensor | None = None,
                is_cap: float = 2.0, dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level aggregated loss over ``mask`` (1 = trained token), divided by ``num_tokens``.

    Without ``proximal_logp`` this is plain PPO-clip against the behaviour logprobs. With it, it is
    decoupled PPO: clip against the proximal policy, weight by the truncated behaviour ratio.
    ``num_tokens`` is the trained-token count of the *whole batch*, so micro-batches add up exactly.
    """
    mask = mask.float()
    if proximal_logp is None:
        tok_loss, clipped = ppo_token_loss(logp, behaviour_logp, adv, clip_eps, dual_clip)
    else:
        tok_loss, clipped = ppo_token_loss(logp, proximal_logp, adv, clip_eps, dual_clip)
        tok_loss = tok_loss * truncated_is_weight(proximal_logp, behaviour_logp, is_cap)
    loss = (tok_loss * mask).sum() / max(num_tokens, 1)
    with torch.no_grad():
        log_ratio = (logp - behaviour_logp) * mask
        stats = {
            "clipped": float((clipped * mask).sum()),
            "approx_kl": float(((torch.exp(log_ratio) - 1) - log_ratio).mul(mask).sum()),  # k3 vs behaviour
        }
    return loss, stats


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: ``exp(ref - logp) - (ref - logp) - 1 >= 0``."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1
