"""expert_parallel.py's demo and measurements: one layer with ep = world against the single-device MoE
on every rank's tokens in float64 (largest error of output, aux loss and every gradient; drops per rank
and in all; the bytes each all-to-all sent against n·H·b from the reference's routing), a training run
on a dp = world mesh (losses, step-1 gradients, per-expert load, drops), and the demo that prints them
against one process and, with --compare, beside PyTorch's autograd all-to-all.

    torchrun --nproc_per_node 4 expert_parallel.py [--ep 2] [--capacity-factor 0.5] [--compare]
"""
from __future__ import annotations

import argparse
import os
import statistics
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist

import expert_parallel
from expert_parallel import ExpertParallelMoE, parallelize_experts, sync_gradients, validate_ep
from lab import references
from lab.baseline import TOL64, max_diff, single_process, snapshot
from lab.data import get_batch, load_corpus
from lab.instruments import CommCounter, Timeline
from lab.launch import finish, main as run_main, parse
from lab.model import build_model, get_config, num_params
from lab.report import all_agree, print0, print_by_rank
from mesh import Mesh, init_distributed


def train_ep(cfg, ep: int, steps: int = 3, global_batch: int = 4, seq_len: int = 16, lr: float = 1e-3,
             seed: int = 0, a2a=None, device=None, trace=lambda step: nullcontext(), dtype=torch.float32):
    """The shared model trained with ep expert parallel on a dp = world mesh (call on every rank).
    Returns losses [global mean per step], grads {name: my step-1 gradient, synchronised}, loads [per
    step: layer-0 tokens per global expert], dropped [per step, all ranks], params {name: mine}.
    a2a replaces our all-to-all; trace(step) is a context manager entered around each step."""
    world = dist.get_world_size()
    mesh = Mesh(dp_shard=world, ep=ep)
    model = parallelize_experts(build_model(cfg, seed=seed, dtype=dtype, device=device), mesh)
    for m in (m for m in model.modules() if isinstance(m, ExpertParallelMoE) and a2a):
        m.all_to_all = a2a
    opt, tokens = torch.optim.AdamW(model.parameters(), lr=lr), load_corpus()
    out = dict(losses=[], loads=[], dropped=[])
    for s in range(steps):
        x, y = get_batch(tokens, s, global_batch, seq_len, seed, mesh.rank("dp"), world, device)
        with trace(s):
            loss = model(x, y)
            loss.backward()
            sync_gradients(model, mesh.group("dp"), mesh.group("edp"), world)
            out.setdefault("grads", snapshot(model, grads=True))
            opt.step()
            opt.zero_grad(set_to_none=True)
        mlp = model.layers[0].mlp  # [loss, dropped, global tokens per expert (mine in my experts' slots)]
        stats = torch.zeros(cfg.n_experts + 2, dtype=torch.float64, device=device)
        stats[0], stats[1] = loss.item(), mlp.dropped
        stats[2 + mlp.first:2 + mlp.first + mlp.n_local] = mlp.tokens_per_expert
        dist.all_reduce(stats)
        out["losses"].append(stats[0].item() / world)
        out["dropped"].append(int(stats[1]))
        out["loads"].append(stats[2:].tolist())
    return dict(out, params=snapshot(model))


def layer_check(cfg, tokens: int, skew: float = 0.0, seed: int = 1, device=None) -> dict:
    """One ep = world layer on this rank's `tokens` rows against the single-device MoE on all ranks'
    rows (float64): the largest error of output, aux loss and every gradient; drops (mine, and the
    reference's in all); bytes each token all-to-all sent (CommCounter) and, from the reference's
    routing, the n·H·8 it should send. skew > 0 adds one direction to every token (a skewed router)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(dp_shard=world, ep=world)
    ref = build_model(cfg, seed=0, dtype=torch.float64, device=device).layers[0].mlp
    layer = ExpertParallelMoE(build_model(cfg, 0, torch.float64, device).layers[0].mlp, mesh.group("ep"))
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(world * tokens, 1, cfg.dim, generator=g, dtype=torch.float64)
    x_all = (x_all + skew * torch.randn(cfg.dim, generator=g, dtype=torch.float64)).to(device)
    dy = torch.randn(x_all.shape, generator=g, dtype=torch.float64).to(device)
    x_ref, sl = x_all.clone().requires_grad_(), slice(rank * tokens, (rank + 1) * tokens)
    ((ref(x_ref) * dy).sum() / len(x_all) + ref.aux_loss).backward()
    x = x_all[sl].clone().requires_grad_()
    with CommCounter() as c:  # measured from outside the layer
        out = layer(x)
        ((out * dy[sl]).sum() * world / len(x_all) + layer.aux_loss).backward()  # (Σ over ranks)/world: ref's
    sync_gradients(layer, mesh.group("dp"), mesh.group("edp"), world)
    lo, n_local = layer.first, layer.n_local
    pairs = [(out, ref(x_all)[sl]), (layer.aux_loss, ref.aux_loss), (x.grad / world, x_ref.grad[sl]),
             (layer.router.weight.grad, ref.router.weight.grad)]
    pairs += [(p.grad, q.grad[lo:lo + n_local]) for p, q in zip(layer.expert_parameters(), (ref.w1, ref.w3, ref.w2))]
    err = max((a - b).abs().max().item() for a, b in pairs)
    # n[s, j]: rows of rank s's tokens the experts of rank j keep, by the reference (first C, rank-major)
    experts, cap = ref.route(x_all.view(-1, cfg.dim))[2].cpu(), ref.capacity(world * tokens)
    n = torch.zeros(world, world, dtype=torch.long)
    for e in range(cfg.n_experts):
        n[:, e // n_local] += torch.bincount((experts == e).nonzero()[:cap, 0] // tokens, minlength=world)
    rows = [int(n[rank].sum() - n[rank, rank]), int(n[:, rank].sum() - n[rank, rank])]  # dispatch, combine
    drops = torch.tensor([layer.dropped], device=device)
    dist.all_reduce(drops)
    return dict(err=err, dropped=layer.dropped, all_dropped=int(drops.item()), ref_dropped=ref.dropped,
                load=layer.tokens_per_expert.tolist(),
                bytes=[int(e.wire_bytes) for e in c.events if e.op == "all_to_all"][-4:],
                want=[r * cfg.dim * 8 for r in rows * 2], assignments=tokens * cfg.top_k)


# ---- the demo: torchrun --nproc_per_node 4 expert_parallel.py [--compare]   (or: python expert_parallel.py) ----

def demo(argv=None, reference=references.all_to_all) -> int:
    """The layer against the single-device MoE (dropless, then with a capacity) with its bytes against the
    formula; then training against one process, and with `reference` (PyTorch's all-to-all, --compare) beside ours."""
    p = argparse.ArgumentParser(description=expert_parallel.__doc__.split("\n")[0]
                                + " (--tokens: per rank, layer check; "
                                "--ep: training's, 0 = all ranks; --batch: global)")
    for name, default in dict(experts=8, top_k=2, ep=0, tokens=64, batch=8, seq=32, steps=4).items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--capacity-factor", type=float, default=0.75)
    p.add_argument("--compare", action="store_true", help="also train with PyTorch's autograd all-to-all")
    args = parse(p, argv)  # (+ --watch, --patience)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep = args.ep or world
    validate_ep(args.experts, args.top_k, ep, args.capacity_factor)  # all before any collective
    if world % ep or min(args.tokens, args.batch, args.seq, args.steps) < 1 or args.batch % world:
        raise ValueError(f"--ep must divide the world size {world}, --tokens, --batch, --seq, --steps be >= 1 "
                         f"and --batch a multiple of {world}")
    cfg, device = get_config("tiny", n_experts=args.experts, top_k=args.top_k), init_distributed()
    rank, lines, ok = dist.get_rank(), [], True
    print0(f"expert parallel: world {world}, E {cfg.n_experts}, top-{cfg.top_k}; layer check with ep = {world}, "
           f"training with ep = {ep} ({cfg.n_experts // ep} experts per rank)")
    for cf in (None, args.capacity_factor):
        r = layer_check(replace(cfg, capacity_factor=cf), args.tokens, device=device)
        name, bytes_ok = "dropless" if cf is None else f"capacity factor {cf}", r["bytes"] == r["want"]
        ok &= r["err"] < 1e-9 and bytes_ok and r["all_dropped"] == r["ref_dropped"]
        print0(f"[{name}] dropped {r['all_dropped']} of {world * r['assignments']} "
               f"(single-device MoE: {r['ref_dropped']})")
        lines.append(f"  rank {rank} [{name}]: max |error| vs single-device MoE (fp64) {r['err']:.1e}; "
                     f"tokens per local expert {r['load']}; dropped {r['dropped']}/{r['assignments']}\n"
                     f"      bytes sent per all-to-all (dispatch, combine, combine-bwd, dispatch-bwd) {r['bytes']}\n"
                     f"      formula n_sent·H·b for the reference's routing {r['want']} "
                     f"{'ok' if bytes_ok else 'MISMATCH'}; uniform routing T·k·H·b·(ep-1)/ep = "
                     f"{r['assignments'] * cfg.dim * 8 * (world - 1) // world}")
    print_by_rank("\n".join(lines))

    # training: ep experts per group against ONE process on the same global batches — the losses, and
    # step 1's gradients (a 2x error in the expert gradients hardly moves AdamW's losses: it shows here).
    # In float64, so "equal" means rounding (TOL64): in fp32 AdamW turns rounding on a gradient that is ~0 into
    # whole steps, and the top-k routing of a token whose two scores nearly tie can flip (lab/baseline.py)
    batches = [get_batch(load_corpus(), s, args.batch, args.seq, device=device) for s in range(args.steps)]
    ref, runs = single_process(build_model(cfg, dtype=torch.float64, device=device), batches, keep_grads=True), {}
    contenders = [("ours", None)]
    if args.compare and reference is not None:
        contenders.append(("PyTorch's all_to_all_single_autograd", reference))
    for name, a2a in contenders:
        tl = Timeline(device)
        runs[name] = train_ep(cfg, ep, args.steps, args.batch, args.seq, a2a=a2a, device=device,
                              trace=lambda s: tl.span("step"), dtype=torch.float64)
        runs[name]["ms"] = 1e3 * statistics.median(s["end"] - s["start"] for s in tl.spans[1:] or tl.spans)
    res, lo = runs["ours"], rank % ep * (cfg.n_experts // ep)
    mine, experts = res["grads"], [n for n in res["grads"] if n.endswith(("mlp.w1", "mlp.w3", "mlp.w2"))]
    want = {n: g[lo:lo + mine[n].shape[0]] if n in experts else g for n, g in ref["grads"][0].items()}
    d_exp, d_all = max_diff(*({n: d[n] for n in experts} for d in (mine, want))), max_diff(mine, want)
    ratio = (sum(mine[n].norm() ** 2 for n in experts) / sum(want[n].norm() ** 2 for n in experts)).sqrt().item()
    print_by_rank(f"  rank {rank}: step-1 gradients vs one process: max |diff| {d_all:.1e} (experts {d_exp:.1e}); "
                  f"expert gradient norm ours / one process = {ratio:.3f}")
    n_all, n_exp = num_params(cfg), cfg.n_layers * 3 * cfg.n_experts * cfg.dim * cfg.ffn_dim
    n_mine = sum(p.numel() for p in res["params"].values())
    memory_ok = n_mine == n_all - n_exp * (ep - 1) // ep
    ok &= d_all < TOL64 and max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])) < TOL64 and memory_ok
    print0(f"parameters per rank {n_mine:,} = all {n_all:,} - (1 - 1/ep) x experts {n_exp:,}: "
           f"{'ok' if memory_ok else 'MISMATCH'}\ntraining {args.steps} steps, global batch {args.batch}x{args.seq}, "
           f"dropless, AdamW, float64 (equal: within {TOL64:.0e}):\n"
           f"  one process losses {[round(v, 6) for v in ref['losses']]}")
    for name, r in runs.items():
        print0(f"  ep={ep} ({name}) losses {[round(v, 6) for v in r['losses']]}  max |diff| "
               f"{max(abs(a - b) for a, b in zip(r['losses'], ref['losses'])):.1e}  step {r['ms']:.1f} ms")
    if args.compare:
        print0(f"  step time ours / PyTorch's: {res['ms'] / runs[name]['ms']:.2f}")
    ok = all_agree(ok)
    print0("expert parallel matches the single-device model:", "ok" if ok else "FAILED")
    return finish(ok)


def main(argv=None) -> None:
    run_main(demo, argv)
