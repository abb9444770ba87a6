"""mesh.py's demo: each rank's place in the mesh and its groups, and every collective run once,
checked for its values and counted (API bytes, ring bytes) next to the formula.

    torchrun --nproc_per_node 4 mesh.py [--pp P --dp-replicate R --dp-shard D --cp C --tp T --ep E]
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from lab.instruments import CommCounter, wire_bytes
from lab.launch import finish, main as run_main, parse
from lab.report import all_agree, print0, print_by_rank
from mesh import DIMS, FLAT, Mesh, all_gather_single, init_distributed, reduce_scatter_single, validate_mesh


def demo(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Each rank's place in the mesh, and every collective checked once.")
    for d in DIMS + ("ep",):
        ap.add_argument("--" + d.replace("_", "-"), type=int, default=None)
    ap.add_argument("--numel", type=int, default=840, help="elements per collective (divisible by the world size)")
    args = parse(ap, argv)  # (+ --watch, --patience)
    sizes = {d: getattr(args, d) for d in DIMS if getattr(args, d) is not None}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # No sizes given: 4 ranks show a 2 x 2 mesh (dp_shard x tp), any other world one dp_shard row.
    shape = sizes or (dict(dp_shard=2, tp=2) if world == 4 else dict(dp_shard=world))
    ep = args.ep or 1
    validate_mesh({d: shape.get(d, 1) for d in DIMS}, world, ep)  # before joining: every rank alike
    device = init_distributed()
    rank = dist.get_rank()
    mesh = Mesh(**shape, ep=ep)
    print0(f"world size {world}, {mesh}, backend {dist.get_backend()}, device {device}")
    lines = [f"rank {rank}: coords {mesh.coords}"]
    for d in DIMS + tuple(FLAT) + ("ep", "edp", "edp_cp"):
        lines.append(f"    {d:12s} group {mesh.ranks(d)} (my index {mesh.rank(d)})")
    print_by_rank("\n".join(lines))

    # Every collective once, on N elements (the N of the formulas in the docstring), checked for its
    # values and counted by CommCounter: API bytes handed to it, and the bytes a ring sends per rank.
    P, N, f = world, args.numel, torch.float32
    if N % P:
        raise ValueError(f"--numel {N} must be divisible by the world size {P}")
    rows, checks = [], []

    def run(name, op, check):
        with CommCounter() as c:
            got = op()
        ev = [e for e in c.events if e.op != "recv"][0]
        rows.append((name, ev.api_bytes, ev.wire_bytes, wire_bytes(ev.op, N * 4, P)))
        checks.append((name, bool(check(got))))

    mine = torch.arange(N, dtype=f, device=device) + rank
    total = P * torch.arange(N, dtype=f, device=device) + P * (P - 1) / 2       # sum over ranks of mine

    def all_reduce():
        x = mine.clone()
        dist.all_reduce(x)
        return x
    run("all_reduce", all_reduce, lambda x: torch.equal(x, total))

    def all_gather():  # each rank brings N/P, everyone gets all N
        out = torch.empty(N, dtype=f, device=device)
        all_gather_single(out, torch.full((N // P,), float(rank), device=device))
        return out
    run("all_gather", all_gather, lambda x: torch.equal(x, torch.arange(P, device=device).float().repeat_interleave(N // P)))

    def reduce_scatter():  # each rank brings N, keeps the sum of its N/P slice
        out = torch.empty(N // P, dtype=f, device=device)
        reduce_scatter_single(out, mine.clone())
        return out
    run("reduce_scatter", reduce_scatter, lambda x: torch.equal(x, total.view(P, -1)[rank]))

    def all_to_all():  # rank r sends its j-th slice to rank j, so it receives everyone's r-th slice
        out = torch.empty(N, dtype=f, device=device)
        dist.all_to_all_single(out, mine.clone())
        return out
    run("all_to_all", all_to_all, lambda x: torch.equal(
        x, torch.cat([(torch.arange(N, dtype=f, device=device) + i).view(P, -1)[rank] for i in range(P)])))

    def broadcast():
        x = mine.clone()
        dist.broadcast(x, src=0)
        return x
    run("broadcast", broadcast, lambda x: torch.equal(x, torch.arange(N, dtype=f, device=device)))

    if P > 1:  # around a ring: send right, receive from the left (one batch, so no pair deadlocks)
        def send_recv():
            recv = torch.empty(N, dtype=f, device=device)
            ops = [dist.P2POp(dist.isend, mine.clone(), (rank + 1) % P), dist.P2POp(dist.irecv, recv, (rank - 1) % P)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            return recv
        run("send/recv ring", send_recv, lambda x: torch.equal(x, torch.arange(N, dtype=f, device=device) + (rank - 1) % P))

    # A collective on a sub-group: all-reduce inside this rank's tp (or dp_shard) group.
    dim = "tp" if mesh.size("tp") > 1 else "dp_shard"
    y = torch.ones(1, device=device)
    dist.all_reduce(y, group=mesh.group(dim))
    checks.append((f"all_reduce on {dim} group", y.item() == mesh.size(dim)))

    print0(f"collectives on N = {N} fp32 elements ({4 * N} bytes), P = {P} ranks (rank 0's counts):")
    print0(f"  {'':16s} {'API bytes':>10s} {'ring bytes sent':>16s} {'formula':>8s}")
    for name, api, wire, formula in rows:
        print0(f"  {name:16s} {api:10,d} {wire:16,.0f} {formula:8,.0f}")
    for name, ok in checks:
        print0(f"  {name:26s} {'ok' if ok else 'WRONG'}")
    ok = all_agree(all(ok for _, ok in checks))
    print0("every collective checked on every rank:", "ok" if ok else "FAILED")
    return finish(ok)


def main(argv=None) -> None:
    run_main(demo, argv)
