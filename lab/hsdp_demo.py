"""hsdp.py's demo and measurements: HSDP trained on a replicate x shard mesh, the bytes on each mesh
dimension measured beside the formulas, the model state per rank, the parameters against one process
and, with --compare, against PyTorch's FSDP2 HSDP (`fully_shard` on a 2-D device mesh).

    torchrun --nproc_per_node 4 hsdp.py [--replicate R] [--bf16] [--compare]
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from lab import references
from lab.data import get_batch, load_corpus
from lab.baseline import max_diff
from lab.fsdp_demo import one_process_check, train_and_measure
from lab.instruments import wire_bytes
from lab.launch import finish, main as run_main, parse
from lab.model import build_model
from lab.report import all_agree, print0, print_by_rank
from mesh import Mesh, init_distributed


def hsdp_train(replicate: int, shard: int, **kwargs) -> dict:
    """A rank function: HSDP on a replicate x shard mesh; fsdp_demo.train_and_measure's result plus the
    bytes measured on each mesh dimension and the formulas for them."""
    mesh = Mesh(dp_replicate=replicate, dp_shard=shard)
    res = train_and_measure(3, group=mesh.group("dp_shard"), replicate_group=mesh.group("dp_replicate"), **kwargs)
    shard_ranks, rep_ranks = tuple(mesh.ranks("dp_shard")), tuple(mesh.ranks("dp_replicate"))
    by_dim = {"dp_shard": {}, "dp_replicate": {}, "other": {}}
    for op, ranks, n in res["events"]:
        dim = "dp_shard" if ranks == shard_ranks else "dp_replicate" if ranks == rep_ranks else "other"
        by_dim[dim][op] = by_dim[dim].get(op, 0) + n
    # train_and_measure's formula counts both dimensions' all-reduces together: the used-flags go over
    # dp_shard, the gradient shards (and the flags again) across dp_replicate
    f, flags = dict(res["comm_formula"]), 4 * res["n_params"] if shard > 1 else 0
    rep = {"all_reduce": f.pop("all_reduce", 0) - flags} if replicate > 1 else {}
    if flags:
        f["all_reduce"] = flags
    res.update(bytes_by_dim=by_dim, shard_ranks=shard_ranks, replicate_ranks=rep_ranks,
               bytes_formula={"dp_shard": f, "dp_replicate": rep})
    return res


# ---- the demo: torchrun --nproc_per_node 4 hsdp.py [--replicate R] [--compare] -----------------------

def demo(argv=None, reference=references.hsdp2) -> int:
    ap = argparse.ArgumentParser(description="HSDP: ZeRO-3 within dp_shard, all-reduce across dp_replicate")
    ap.add_argument("--replicate", type=int, default=None, help="replica groups (default 2, or 1 on an odd world)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bf16", action="store_true", help="bf16 compute copies, fp32 master and reduction")
    ap.add_argument("--compare", action="store_true", help="also train PyTorch's FSDP2 HSDP (a 2-D mesh)")
    args = parse(ap, argv)  # (+ --watch, --patience)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    R = args.replicate or (2 if world % 2 == 0 else 1)
    if R < 1 or world % R or args.batch % world:  # arithmetic only: every rank says it, before any collective
        raise ValueError(f"--replicate {R} must divide the {world} ranks, and --batch {args.batch} be a multiple "
                         f"of them: try --replicate {2 if world % 2 == 0 else 1} --batch {world * 2}")
    S, pd = world // R, torch.bfloat16 if args.bf16 else None
    device = init_distributed()
    res = hsdp_train(R, S, model_name=args.model, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
                     param_dtype=pd)
    print0(f"HSDP {R} replicas x {S} shards, model {args.model} (Ψ = {res['numel']:,} padded); "
           f"losses {[round(x, 4) for x in res['losses']]}")
    lines = [f"rank {dist.get_rank()}: shard group {list(res['shard_ranks'])}, "
             f"replicate group {list(res['replicate_ranks'])}"]
    for dim, size in (("dp_shard", S), ("dp_replicate", R)):
        for op in sorted(set(res["bytes_by_dim"][dim]) | set(res["bytes_formula"][dim])):
            got, want = res["bytes_by_dim"][dim].get(op, 0), res["bytes_formula"][dim].get(op, 0)
            lines.append(f"    {dim:12s} {op:14s} API bytes {got:>9,} | formula {want:>9,}   "
                         f"ring wire {wire_bytes(op, got, size):>10,.0f} | {wire_bytes(op, want, size):>10,.0f}")
    if res["bytes_by_dim"]["other"]:
        lines.append(f"    UNEXPECTED collectives on other groups: {res['bytes_by_dim']['other']}")
    mem, form = res["memory"], res["memory_formula"]
    lines.append("    model state bytes (measured | formula (b_p+b_g+K)Ψ/S): " + ", ".join(
        f"{k} {mem[k]:,} | {form[k]:,.0f}" for k in ("parameters", "master", "gradients", "optimizer", "total"))
        + " (optimizer: + AdamW's step counter per parameter piece)")
    print_by_rank("\n".join(lines))

    res64 = hsdp_train(R, S, model_name=args.model, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
                       dtype=torch.float64)  # the same mesh in float64: the verdict (fsdp_demo.one_process_check)
    ok = one_process_check([("", res["state"], res64["state"])], args.model, args.steps, args.batch, args.seq,
                           args.lr, pd, device)
    ok &= all_agree(not res["bytes_by_dim"]["other"])
    if args.compare and reference is not None and S * R > 1:  # FSDP2's HSDP: fully_shard on a 2-D device mesh
        tokens = load_corpus()
        theirs = build_model(args.model, seed=0, device=device)
        reference(theirs, R, S, param_dtype=pd)
        opt = torch.optim.AdamW(theirs.parameters(), lr=args.lr)
        for s in range(args.steps):
            theirs(*get_batch(tokens, s, args.batch, args.seq, 0, dist.get_rank(), world, device=device)).backward()
            opt.step()
            opt.zero_grad()
        same = max_diff({n: p.full_tensor() for n, p in theirs.named_parameters()}, res["state"])
        print0(f"PyTorch FSDP2 HSDP (fully_shard on a {R} x {S} mesh): max |diff| to ours = {same:.2e}")
        del theirs, opt  # FSDP2's state goes while the process group still exists
    return finish(ok)


def main(argv=None) -> None:
    run_main(demo, argv)
