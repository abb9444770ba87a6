"""Lesson 3 — hybrid sharding (HSDP): ZeRO-3 inside a group, plain replication across groups.

The idea
--------
FSDP over all P ranks makes every all-gather and reduce-scatter span the whole job,
across the slow links between nodes. HSDP lays the data-parallel ranks out as a 2-D mesh

    dp = dp_replicate (R) x dp_shard (S)          (ranks of one shard group: one node)

and runs fsdp.py's stage 3 *inside* each shard group of S ranks. The R shard groups hold
the same shards (replicas); after a unit's gradient is reduce-scattered inside its shard
group, only that reduced slice (1/S of the gradient) is all-reduced across the replicate
group. Nothing is all-gathered across replicas.

Communication per step (API bytes, Ψ elements, b_p parameter bytes, fp32 gradients):
    shard dim      all-gather b_p·(2Ψ − Ψ_root)   reduce-scatter 4Ψ      (ring: × (S−1)/S)
    replicate dim  all-reduce 4Ψ/S                                       (ring: × 2(R−1)/R)
Model state per rank: (b_p + b_g + K)·Ψ/S — sharded S ways, not R·S: HSDP trades memory
for keeping the big collectives on the fast links.

    torchrun --nproc_per_node 4 hsdp.py          # 2 x 2: prints bytes per dimension and memory
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from fsdp import train_and_measure, zero_comm_formula
from mesh import Mesh


def hsdp_train(replicate: int, shard: int, **kwargs) -> dict:
    """A rank function: HSDP on a replicate x shard mesh; fsdp.train_and_measure's result plus
    the bytes measured on each mesh dimension and the formulas for them."""
    mesh = Mesh(dp_replicate=replicate, dp_shard=shard)
    res = train_and_measure(3, group=mesh.group("dp_shard"), replicate_group=mesh.group("dp_replicate"), **kwargs)
    shard_ranks, rep_ranks = tuple(mesh.ranks("dp_shard")), tuple(mesh.ranks("dp_replicate"))
    by_dim = {"dp_shard": {}, "dp_replicate": {}, "other": {}}
    for op, ranks, n in res["events"]:
        dim = "dp_shard" if ranks == shard_ranks else "dp_replicate" if ranks == rep_ranks else "other"
        by_dim[dim][op] = by_dim[dim].get(op, 0) + n
    f = zero_comm_formula(3, res["numel"], shard, res["param_bytes"], res["root_numel"],
                          kwargs.get("reshard_after_forward", True), replicate)
    res.update(bytes_by_dim=by_dim, shard_ranks=shard_ranks, replicate_ranks=rep_ranks,
               bytes_formula={"dp_shard": {k: v for k, v in f.items() if k != "all_reduce"},
                              "dp_replicate": {"all_reduce": f["all_reduce"]} if replicate > 1 else {}})
    return res


if __name__ == "__main__":
    from instruments import wire_bytes
    from mesh import init_distributed, print0

    ap = argparse.ArgumentParser(description="HSDP: ZeRO-3 within dp_shard, all-reduce across dp_replicate")
    ap.add_argument("--replicate", type=int, default=None, help="replica groups (default 2, or 1 on an odd world)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bf16", action="store_true", help="bf16 compute copies, fp32 master and reduction")
    args = ap.parse_args()
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.replicate is None:
        args.replicate = 2 if world % 2 == 0 else 1
    if args.replicate < 1 or world % args.replicate:
        raise SystemExit(f"--replicate {args.replicate} must divide the number of ranks ({world})")
    R, S = args.replicate, world // args.replicate
    res = hsdp_train(R, S, model_name=args.model, steps=args.steps, batch=args.batch, seq=args.seq,
                     lr=args.lr, param_dtype=torch.bfloat16 if args.bf16 else None)
    print0(f"HSDP {R} replicas x {S} shards, model {args.model} (Ψ = {res['numel']:,} padded); "
           f"losses {[round(x, 4) for x in res['losses']]}")
    lines = [f"rank {rank}: shard group {list(res['shard_ranks'])}, replicate group {list(res['replicate_ranks'])}"]
    for dim, size in (("dp_shard", S), ("dp_replicate", R)):
        for op in sorted(set(res["bytes_by_dim"][dim]) | set(res["bytes_formula"][dim])):
            got, want = res["bytes_by_dim"][dim].get(op, 0), res["bytes_formula"][dim].get(op, 0)
            lines.append(f"    {dim:12s} {op:14s} API bytes {got:>9,} | formula {want:>9,}   "
                         f"ring wire {wire_bytes(op, got, size):>10,.0f} | {wire_bytes(op, want, size):>10,.0f}")
    if res["bytes_by_dim"]["other"]:
        lines.append(f"    UNEXPECTED collectives on other groups: {res['bytes_by_dim']['other']}")
    mem, form = res["memory"], res["memory_formula"]
    lines.append("    model state bytes (measured | formula (b_p+b_g+K)Ψ/S): "
                 + ", ".join(f"{k} {mem[k]:,} | {form[k]:,.0f}" for k in ("parameters", "master", "gradients",
                                                                          "optimizer", "total")))
    for r in range(world):
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    ok = not res["bytes_by_dim"]["other"]
    if rank == 0:  # the single-process run on the same global batches
        from data import get_batch, load_corpus
        from model import build_model
        model = build_model(args.model, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        tokens = load_corpus()
        for s in range(args.steps):
            model(*get_batch(tokens, s, args.batch, args.seq, 0)).backward()
            opt.step()
            opt.zero_grad()
        err = max((torch.as_tensor(res["state"][n]) - p.detach()).abs().max().item()
                  for n, p in model.named_parameters())
        tol = (2.0 if args.bf16 else 0.05) * args.lr * args.steps  # as in fsdp.py
        ok = ok and err < tol
        print(f"parameters vs the single-process run: max |diff| = {err:.2e} (tolerance {tol:.1e}) -> "
              f"{'ok' if err < tol else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)
