"""Lesson 3 — hybrid sharding (HSDP): ZeRO-3 inside a group of ranks, plain replication across groups.

FSDP over all P ranks makes every all-gather and reduce-scatter span the whole job, across the slow
links between nodes. HSDP lays the data-parallel ranks out as a 2-D mesh (Zhao et al. 2023, "PyTorch
FSDP", arXiv:2304.11277 §3.2, hybrid sharding)

    dp = dp_replicate (R) x dp_shard (S)          (the S ranks of a shard group: one node)

and runs fsdp.py's stage 3 *inside* each shard group. The R shard groups hold the same shards
(replicas): once a unit's gradient is reduce-scattered inside its shard group, only that reduced
slice, 1/S of the gradient, is all-reduced across the replicas, and the sum is divided by all S·R
data-parallel ranks. Nothing is ever all-gathered across replicas. fsdp.py offers one seam for it,
shard_model's `after_reduce`: a function run on every reduced gradient shard (and on the flags that say
which parameters got a gradient) after the reduce-scatter and before the division. This file is what
goes through that seam — `across_replicas` — and the one call that shards a model this way.

Per step, API bytes (what is handed to the collective; Ψ elements, b_p parameter bytes, fp32
gradients; what one rank sends on a ring is mesh.py's factor for each collective, over S or R ranks):
    shard dim      all-gather b_p·(2Ψ − Ψ_root)   reduce-scatter 4Ψ
    replicate dim  all-reduce 4Ψ/S
    both dims      all-reduce 4k: one int32 per parameter tensor (k of them), the used-flags
(Ψ_root: the root unit's parameters, gathered once; 0 for the course's model: fsdp.default_units.)
Model state per rank: fsdp.py's stage 3 (lesson 2) with P = S — sharded S ways, not R·S: HSDP trades
memory for keeping the big collectives on the fast links.

    torchrun --nproc_per_node 4 hsdp.py          # 2 x 2: bytes on each mesh dimension, memory, parity
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from fsdp import AGREE_FIX, Seams, ZeroOptimizer, shard_model
from mesh import Mesh, agree


def across_replicas(replicate_group):
    """HSDP's one addition to ZeRO, for fsdp.shard_model's after_reduce: a gradient shard [n], already
    summed over my shard group by the reduce-scatter, is summed across the replicas that hold the same
    shard (they differ only in the data they saw). The used-flags [k] take the same road, so a parameter
    that only another replica's data reached still gets its gradient here."""
    def all_reduce_across(t):
        agree(replicate_group, f"all-reduces {t.numel()} summed gradient elements across replicas", AGREE_FIX)
        dist.all_reduce(t, group=replicate_group)
    all_reduce_across.group = replicate_group   # (whose ranks agree on each step: mesh.agree_step)
    return all_reduce_across


def shard_hybrid(model, mesh: Mesh | None = None, *, stage: int = 3, shard_group=None, replicate_group=None,
                 **kwargs) -> ZeroOptimizer:
    """Shard `model` by ZeRO `stage` (HSDP: 3; 1 and 2 work alike) inside each shard group, replicas across
    the replicate group; returns fsdp's ZeroOptimizer. The groups are mesh's dp_shard and dp_replicate, or
    given (train.py shards over dp_shard × cp). The gradient sum is divided by all S·R ranks (seams=
    fsdp.Seams(divide_by=...) overrides it); other keywords go to fsdp.shard_model."""
    if stage == 0:  # arithmetic: every rank raises alike, before any collective
        raise ValueError("stage 0 already replicates everything: hybrid sharding (a replicate_group across "
                         "shard groups) goes with stage 1, 2 or 3")
    if mesh is None and (shard_group is None or replicate_group is None):
        raise ValueError("shard_hybrid needs a Mesh (its dp_shard and dp_replicate groups) or both shard_group "
                         "and replicate_group")
    shard_group = shard_group if shard_group is not None else mesh.group("dp_shard")
    replicate_group = replicate_group if replicate_group is not None else mesh.group("dp_replicate")
    S, R = dist.get_world_size(shard_group), dist.get_world_size(replicate_group)
    seams = kwargs.pop("seams", None) or Seams()
    seams = dataclasses.replace(seams, divide_by=seams.divide_by or S * R,
                                after_reduce=across_replicas(replicate_group) if R > 1 else None)
    return shard_model(model, stage, group=shard_group, seams=seams, **kwargs)


if __name__ == "__main__":  # the demo (bytes on each mesh dimension, one process, FSDP2's HSDP) is in the package
    from lab.hsdp_demo import main
    main()
