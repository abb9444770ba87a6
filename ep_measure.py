"""Expert parallel measured (expert_parallel.py): one layer with ep = world against the single-device
MoE on every rank's tokens in float64 (largest error of output, aux loss and every gradient; drops per
rank and in all; the bytes each all-to-all sent against n·H·b from the reference's routing), and a
training run on a dp = world mesh (losses, step-1 gradients, per-expert load, drops). The demo, the
tests and the notebook compare these with one process; the lesson itself is expert_parallel.py.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from data import get_batch, load_corpus
from demo import snapshot
from expert_parallel import ExpertParallelMoE, parallelize_experts, sync_gradients
from instruments import CommCounter
from mesh import Mesh
from model import build_model


def run_in_turn(*calls):
    """[fn(*args) for (fn, args) in calls] on every rank: several measurements, one spawn of ranks."""
    return [fn(*args) for fn, args in calls]


def train_ep(cfg, ep: int, steps: int = 3, global_batch: int = 4, seq_len: int = 16, lr: float = 1e-3,
             seed: int = 0, a2a=None, device=None, trace=lambda step: nullcontext()):
    """The shared model trained with ep expert parallel on a dp = world mesh (call on every rank).
    Returns losses [global mean per step], grads {name: my step-1 gradient, synchronised}, loads [per
    step: layer-0 tokens per global expert], dropped [per step, all ranks], params {name: mine}.
    a2a replaces our all-to-all; trace(step) is a context manager entered around each step."""
    world = dist.get_world_size()
    mesh = Mesh(dp_shard=world, ep=ep)
    model = parallelize_experts(build_model(cfg, seed=seed, device=device), mesh)
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
    lo, El = layer.first, layer.n_local
    pairs = [(out, ref(x_all)[sl]), (layer.aux_loss, ref.aux_loss), (x.grad / world, x_ref.grad[sl]),
             (layer.router.weight.grad, ref.router.weight.grad)]
    pairs += [(p.grad, q.grad[lo:lo + El]) for p, q in zip(layer.expert_parameters(), (ref.w1, ref.w3, ref.w2))]
    err = max((a - b).abs().max().item() for a, b in pairs)
    # n[s, j]: rows of rank s's tokens the experts of rank j keep, by the reference (first C, rank-major)
    experts, cap = ref.route(x_all.view(-1, cfg.dim))[2].cpu(), ref.capacity(world * tokens)
    n = torch.zeros(world, world, dtype=torch.long)
    for e in range(cfg.n_experts):
        n[:, e // El] += torch.bincount((experts == e).nonzero()[:cap, 0] // tokens, minlength=world)
    rows = [int(n[rank].sum() - n[rank, rank]), int(n[:, rank].sum() - n[rank, rank])]  # dispatch, combine
    drops = torch.tensor([layer.dropped], device=device)
    dist.all_reduce(drops)
    return dict(err=err, dropped=layer.dropped, all_dropped=int(drops.item()), ref_dropped=ref.dropped,
                load=layer.tokens_per_expert.tolist(),
                bytes=[int(e.wire_bytes) for e in c.events if e.op == "all_to_all"][-4:],
                want=[r * cfg.dim * 8 for r in rows * 2], assignments=tokens * cfg.top_k)
