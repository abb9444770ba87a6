"""Checkpoints of a model sharded by fsdp.shard_model (ZeRO stages 0-3): two layouts.

    full     {name: whole tensor}, the same on every rank, as the plain model's state_dict() has it
             (a tied weight under each of its names; frozen parameters and buffers too), so it loads
             with load_state_dict(strict=True) into an unsharded model. Making it all-gathers every
             unit's master slices: API bytes b_m·Ψ (b_m = 4 for fp32 masters); a ring sends (P-1)/P of it.
    sharded  this rank's master slices [n] and its optimizer's state: no collective at all, and it
             reloads only into the same layout (same P, same units) — what a resumed run needs.

Either load writes the master slices and then refreshes every compute copy (FlatUnit.publish):
stages 1-2 all-gather the new parameters, stage 3 drops any gathered copy, which would be stale.
(Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277 §3.3: full vs sharded state dicts.)
These functions are ZeroOptimizer's methods: opt.full_state_dict(), opt.load_shard_state_dict(sd), ...
"""
from __future__ import annotations

import copy

import torch

from mesh import all_gather_single


def _unsharded(opt) -> dict:
    """The module's frozen parameters and buffers: every rank keeps them whole."""
    sharded = {n for u in opt.units for names in u.aliases for n in names}
    return {k: v for k, v in opt.module.state_dict().items() if k not in sharded}


@torch.no_grad()
def full_state_dict(opt) -> dict:
    """{name: whole tensor} on every rank: each parameter gathered from the master slices, under every
    name the plain model's state_dict() has for it, and the frozen parameters and buffers."""
    out = {k: v.detach().clone() for k, v in _unsharded(opt).items()}
    for u in opt.units:
        full = u.master.detach()  # stage 0: the whole buffer (its views are cloned below)
        if opt.stage > 0:
            full = full.new_empty(u.N)
            all_gather_single(full, u.master.detach(), group=u.group)
        out.update((n, v.clone()) for names, v in zip(u.aliases, u.views(full)) for n in names)
    return out


@torch.no_grad()
def load_full_state_dict(opt, sd: dict) -> None:
    """Load a full state dict (the same on every rank): each rank takes its slices and refreshes its
    compute copies (any gathered copy is dropped); frozen parameters and buffers are copied whole."""
    for u in opt.units:
        full = torch.cat([sd[name].reshape(-1).to(u.master) for name in u.names] + [u.master.new_zeros(u.N - sum(u.numels))])
        u.master.copy_(full[u.r * u.n:(u.r + 1) * u.n])
        u.publish()
    for k, v in _unsharded(opt).items():
        v.copy_(sd[k])


def shard_state_dict(opt) -> dict:
    """This rank's training state, for a checkpoint the same layout reloads: its master slices and the
    inner optimizer's state (frozen parameters and buffers never change: they are not in it)."""
    return copy.deepcopy(dict(masters=[u.master.detach() for u in opt.units], optimizer=opt.inner.state_dict()))


@torch.no_grad()
def load_shard_state_dict(opt, sd: dict) -> None:
    for u, m in zip(opt.units, sd["masters"], strict=True):
        u.master.copy_(m)
        u.publish()  # compute copies refreshed; stage 3 drops any gathered (now stale) buffer
    opt.inner.load_state_dict(sd["optimizer"])
