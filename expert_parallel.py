"""Lesson 7 — expert parallel: the experts of a mixture of experts live on different ranks.

The idea
--------
A mixture-of-experts (MoE) MLP has E experts and a router that sends each token to k of
them (model.py's `MoE` is the single-device reference). Expert parallelism splits the
experts, not the tokens: each of the ep ranks of an "ep" group holds E/ep experts (a slice
of the stacked weights), keeps its own tokens, and every MoE layer

  1. routes its T tokens: probs [T, E], top-k experts and weights [T, k];
  2. exchanges *counts* first (an all-to-all of [ep, E/ep + 1] integers), so every rank
     knows how many rows it will receive from whom before any token moves;
  3. *dispatches*: sorts its T·k assignments by expert (= by owner rank) and sends the rows
     with one all_to_all_single with uneven splits;
  4. runs its local experts on what arrived;
  5. *combines*: the reverse all-to-all brings each result home, where it is scaled by its
     router weight and summed into its token.
The backward pass is the same two all-to-alls in reverse order with the splits swapped.

Capacity. Dropless by default. With a capacity factor the reference keeps, per expert,
the first C = ceil(T_all·k/E·cf) assignments in token order. Our reference is the
single-device MoE on the concatenation of the ep ranks' tokens in rank order, so the owner
of expert e keeps C of them counting rank 0's first, then rank 1's, ... — it alone decides,
and tells each sender how many of its rows to send (a second small all-to-all). A
consequence worth seeing: when an expert overflows, the later ranks' tokens are dropped.

Aux loss (Switch): coef·E·Σ_i f_i·P_i with f_i (share of assignments) and P_i (mean router
probability) summed over all ranks' tokens by one all-reduce, so every rank reports the
single-device value of the global batch (coef exactly, when routing is uniform).

Communication per MoE layer and step, per rank (H hidden, b bytes per element):
    counts      all-to-all of ep·(E/ep + 1) int64 (+ ep·E/ep back with a capacity)
    dispatch    all-to-all: sends n_j·H·b to rank j (n_j = my kept assignments to j's experts)
    combine     all-to-all: the same rows back;   backward: both again, splits swapped
    aux loss    all-reduce of 2E + 1 floats (global routing statistics)
    uniform routing: each token all-to-all sends T·k·H·b·(ep−1)/ep bytes to other ranks.
    gradients   expert weights all-reduced over "edp" (dp/ep ranks), the rest over dp.
Memory: each rank holds E/ep of the 3·E·H·F expert parameters (and their gradients and
optimizer state): it saves a fraction (1 − 1/ep) of the expert weights.

Run:  torchrun --nproc_per_node 4 expert_parallel.py   (or: python expert_parallel.py)
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from data import get_batch, load_corpus
from instruments import CommCounter, sync
from mesh import Mesh, init_distributed, print0
from model import MoE, build_model, get_config


def validate_ep(n_experts: int, top_k: int, ep: int, capacity_factor=None) -> None:
    """Raise ValueError on sizes expert parallel cannot run — pure arithmetic, no collective."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be an integer >= 1, got {ep!r}")
    if n_experts < 1 or n_experts % ep:
        raise ValueError(f"n_experts={n_experts} is not divisible by ep={ep}: every rank must hold "
                         f"the same number of experts; choose ep from "
                         f"{[d for d in range(1, n_experts + 1) if n_experts % d == 0]} "
                         f"or a multiple of {ep} experts")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}: "
                         f"a token cannot go to more experts than exist")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None for dropless)")


# ---- the differentiable all-to-all ----------------------------------------------------

def _all_to_all(x, out_splits, in_splits, group):
    """Rows x[sum(in_splits[:j]) : ...+in_splits[j]] go to rank j; out_splits[i] rows come from i."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits, as an autograd op.

    The forward moves rows between ranks without changing them: a permutation of the
    rows of the whole group. The gradient of a permutation is the inverse permutation,
    so each received row's gradient must travel back to the rank that sent the row, into
    the slot it came from: the same all-to-all with in_splits and out_splits swapped.
    """

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all(x, out_splits, in_splits, group):
    return AllToAll.apply(x, out_splits, in_splits, group)


# ---- the layer ---------------------------------------------------------------------------

class ExpertParallelMoE(MoE):
    """model.MoE with its E experts spread over the ranks of `ep_group` (E/ep each).

    Replaces `block.mlp` by assignment: ExpertParallelMoE(block.mlp, ep_group, aux_group).
    It is an MoE (subclass), so Transformer.aux_loss() still adds its auxiliary loss.
    After forward: aux_loss (the group's value), tokens_per_expert [E/ep] rows each local
    expert processed (its load), dropped (this rank's assignments dropped), plan (the splits).
    `aux_group`: the ranks whose tokens the aux loss averages over (default the ep group;
    the training helpers use the whole dp group, so it equals the single-process value).
    """

    def __init__(self, moe: MoE, ep_group, aux_group=None):
        nn.Module.__init__(self)  # not MoE.__init__: that would allocate all E experts
        ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)  # local lookups
        validate_ep(moe.n_experts, moe.top_k, ep, moe.capacity_factor)    # before any collective
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.capacity_factor, self.aux_loss_coef = moe.capacity_factor, moe.aux_loss_coef
        self.ep_group, self.aux_group = ep_group, aux_group if aux_group is not None else ep_group
        self.ep, self.n_local = ep, moe.n_experts // ep
        self.first = rank * self.n_local                     # my experts: first .. first + E/ep - 1
        self.router = moe.router                             # replicated on every rank
        sl = slice(self.first, self.first + self.n_local)
        self.w1 = nn.Parameter(moe.w1.detach()[sl].clone())  # [E/ep, F, H]
        self.w3 = nn.Parameter(moe.w3.detach()[sl].clone())  # [E/ep, F, H]
        self.w2 = nn.Parameter(moe.w2.detach()[sl].clone())  # [E/ep, H, F]
        self.aux_loss, self.tokens_per_expert, self.dropped, self.plan = None, None, 0, None
        self.all_to_all = all_to_all                         # the demo's --compare swaps in PyTorch's

    def expert_parameters(self):
        return [self.w1, self.w3, self.w2]

    def group_aux_loss(self, probs, counts, T):
        """Switch aux loss coef·E·Σ f_i·P_i with f and P over all tokens of aux_group.

        f_i (share of assignments to expert i) has no gradient; P_i (mean router probability)
        does. Its value here is the group's, but each rank differentiates only its own tokens'
        share P_local: averaging gradients over the group (as data parallel does) then sums
        the shares, giving exactly the gradient of the group's P (equal T on every rank).
        """
        E = self.n_experts
        stats = torch.cat([counts.to(probs.dtype), probs.detach().sum(0),
                           torch.tensor([float(T)], dtype=probs.dtype, device=probs.device)])
        dist.all_reduce(stats, group=self.aux_group)                     # [2E + 1] sums
        T_all = stats[-1]
        f, P_all = stats[:E] / (T_all * self.top_k), stats[E:2 * E] / T_all
        P_local = probs.mean(0)
        P = P_all + (P_local - P_local.detach())  # value P_all, gradient of P_local
        return self.aux_loss_coef * E * (f * P).sum()

    def make_plan(self, counts, T):
        """Agree on every split before a token moves. counts [E]: my assignments per expert.

        Returns keep_send [E] (my assignments each expert accepts) and keep_recv [ep, E/ep]
        (rows I get from each rank for each of my experts).
        Why the sizes cannot mismatch (a mismatch hangs or corrupts the all-to-all): every
        number rank j uses to receive from rank s is a number s sent to j, or j's own
        decision that j then sends to s. Dropless: j's recv counts ARE s's counts, moved by
        the counts all-to-all. Capacity: only the owner j decides how many of s's rows its
        experts keep (from the counts of all senders, identical integers), and the decision
        itself travels back to s. No rank ever guesses another rank's numbers.
        """
        ep, El = self.ep, self.n_local
        # row j: my counts for rank j's experts, and my token count (for the capacity)
        msg = torch.cat([counts.view(ep, El), counts.new_full((ep, 1), T)], 1)   # [ep, El + 1]
        got = _all_to_all(msg, [1] * ep, [1] * ep, self.ep_group)              # row s: from rank s
        recv = got[:, :El]                                                       # [ep, El]
        cap = self.capacity(int(got[:, El].sum()))       # C over the group's T_all tokens
        if cap is None:
            return counts, recv
        before = recv.cumsum(0) - recv                   # assignments to e from lower ranks
        keep_recv = torch.minimum((cap - before).clamp(min=0), recv)  # first C, rank-major
        keep_send = _all_to_all(keep_recv, [1] * ep, [1] * ep, self.ep_group)  # row j: j's verdict
        return keep_send.reshape(-1), keep_recv

    def forward(self, x):
        B, S, H = x.shape
        x = x.reshape(-1, H)                                  # [T, H]
        T, k, E, El, ep = x.shape[0], self.top_k, self.n_experts, self.n_local, self.ep
        probs, weights, experts, _ = self.route(x)            # the reference router: [T,E], [T,k], [T,k]
        flat = experts.flatten()                              # [T·k] expert of assignment a = t·k + slot
        counts = torch.bincount(flat, minlength=E)            # [E]
        self.aux_loss = self.group_aux_loss(probs, counts, T)
        keep_send, keep_recv = self.make_plan(counts, T)

        # Sort assignments by expert (stable: token order within an expert, as the reference
        # keeps them), then keep the first keep_send[e] of each expert's queue.
        order = torch.argsort(flat, stable=True)              # [T·k]
        sorted_e = flat[order]
        start = counts.cumsum(0) - counts                     # [E] queue start of each expert
        pos = torch.arange(T * k, device=x.device) - start[sorted_e]
        sel = order[pos < keep_send[sorted_e]]                # [N_send] kept, grouped by owner rank
        tok = torch.div(sel, k, rounding_mode="floor")        # their tokens
        send_splits = keep_send.view(ep, El).sum(1).tolist()  # rows to each rank
        recv_splits = keep_recv.sum(1).tolist()               # rows from each rank

        # dispatch: rows arrive grouped by source rank, then by my expert, in token order
        rows = self.all_to_all(x[tok], recv_splits, send_splits, self.ep_group)   # [N_recv, H]
        row_expert = torch.arange(El, device=x.device).repeat(ep).repeat_interleave(keep_recv.flatten())
        perm = torch.argsort(row_expert, stable=True)         # regroup expert-major: one matmul each
        per_expert = keep_recv.sum(0).tolist()
        ys = [self.expert(e, chunk) for e, chunk in enumerate(rows[perm].split(per_expert))]
        y = torch.cat(ys)[torch.argsort(perm)]                # back to arrival order [N_recv, H]

        # combine: results go home (splits swapped), are weighted and summed into their tokens
        back = self.all_to_all(y, send_splits, recv_splits, self.ep_group)        # [N_send, H]
        w = weights.flatten()[sel]                            # router weight of each kept assignment
        out = torch.zeros_like(x).index_add(0, tok, back * w[:, None])
        self.tokens_per_expert = keep_recv.sum(0)
        self.dropped = T * k - len(sel)
        self.plan = dict(send=send_splits, recv=recv_splits, row_bytes=H * x.element_size(),
                         me=dist.get_rank(self.ep_group))
        return out.view(B, S, H)


def parallelize_experts(model, mesh: Mesh, aux_dim: str = "dp"):
    """Give every MoE block of `model` its expert-parallel layer (in place); returns model."""
    for block in model.layers:
        if isinstance(block.mlp, MoE):  # validate every layer before touching any
            validate_ep(block.mlp.n_experts, block.mlp.top_k, mesh.size("ep"), block.mlp.capacity_factor)
    for block in model.layers:
        if isinstance(block.mlp, MoE):
            block.mlp = ExpertParallelMoE(block.mlp, mesh.group("ep"), mesh.group(aux_dim))
    return model


def sync_gradients(model, dp_group, edp_group, dp_size: int) -> None:
    """Make every gradient that of the mean over dp ranks of each rank's loss.

    Non-expert parameters: every dp rank holds a copy with the gradient of its own loss;
    all-reduce over dp and divide by dp.
    Expert parameters: the backward all-to-all already delivered to me the gradient from
    every rank of my ep group (their tokens visited my experts). The other copies of my
    experts sit on my edp ranks (one per ep group), each with its own group's sum. So sum
    over edp, then divide by dp — not by edp, which would count each loss ep times.
    """
    expert = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE)
              for p in m.expert_parameters()}
    for group, keep in ((dp_group, False), (edp_group, True)):
        params = [p for p in model.parameters() if (id(p) in expert) == keep and p.requires_grad]
        if not params:
            continue
        for p in params:
            if p.grad is None:  # every rank must contribute the same sizes
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.flatten() for p in params])   # one all-reduce per group
        dist.all_reduce(flat, group=group)
        flat /= dp_size
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))


# ---- training, load and drops: the demo, the tests and the notebook use these ---------

def train_ep(cfg, ep: int, steps: int = 3, global_batch: int = 4, seq_len: int = 16, lr: float = 1e-3,
             seed: int = 0, reference_a2a=None, device=None):
    """Train the shared model with ep expert parallel on a dp = world mesh (runs on every rank).

    Returns dict(losses [global mean per step], loads [per step: layer-0 tokens per global
    expert], dropped [per step, all ranks], params {name: local tensor}, step_time).
    """
    world = dist.get_world_size()
    mesh = Mesh(dp_shard=world, ep=ep)
    model = parallelize_experts(build_model(cfg, seed=seed, device=device), mesh)
    if reference_a2a is not None:
        for m in model.modules():
            if isinstance(m, ExpertParallelMoE):
                m.all_to_all = reference_a2a
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens, D = load_corpus(), mesh.size("dp")
    out = dict(losses=[], loads=[], dropped=[], times=[])
    for s in range(steps):
        x, y = get_batch(tokens, s, global_batch, seq_len, seed, mesh.rank("dp"), D, device)
        sync(device)
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        sync_gradients(model, mesh.group("dp"), mesh.group("edp"), D)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        out["times"].append(time.perf_counter() - t0)
        mlp = model.layers[0].mlp
        # [ep] loads of the ep group, summed over ep groups: global tokens per expert
        load = torch.zeros(cfg.n_experts, device=device)
        load[mlp.first:mlp.first + mlp.n_local] = mlp.tokens_per_expert.float()
        dropped = torch.tensor([float(mlp.dropped)], device=device)
        stats = torch.cat([loss.detach().reshape(1).float(), load, dropped])
        dist.all_reduce(stats, group=mesh.group("dp"))
        out["losses"].append(stats[0].item() / D)
        out["loads"].append(stats[1:-1].tolist())
        out["dropped"].append(int(stats[-1].item()))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["step_time"] = sorted(out["times"][1:] or out["times"])[len(out["times"][1:] or out["times"]) // 2]
    return out


def run_in_turn(*calls):
    """[fn(*args) for (fn, args) in calls] on every rank: several measurements, one spawn."""
    return [fn(*args) for fn, args in calls]


def drop_sweep(factors, skews=(0.0,), n_experts: int = 8, top_k: int = 2, tokens: int = 256, seed: int = 0):
    """For each skew, per capacity factor: the fraction of each rank's assignments one ep
    layer (ep = world) drops, and the single-device reference's fraction on all the tokens.
    skew > 0 adds a common direction to every token, so the router favours a few experts."""
    world, rank = dist.get_world_size(), dist.get_rank()
    moe = build_model(get_config("tiny", n_experts=n_experts, top_k=top_k), seed=seed).layers[0].mlp
    g = torch.Generator().manual_seed(seed)
    H = moe.router.in_features
    noise, common = torch.randn(world * tokens, 1, H, generator=g), torch.randn(1, 1, H, generator=g)
    out = {}
    for skew in skews:
        x, out[skew] = noise + skew * common, []
        for cf in factors:
            moe.capacity_factor = cf
            layer = ExpertParallelMoE(moe, dist.group.WORLD)
            with torch.no_grad():
                layer(x[rank * tokens:(rank + 1) * tokens])
                moe(x)
            per_rank = torch.zeros(world)
            per_rank[rank] = layer.dropped
            dist.all_reduce(per_rank)
            out[skew].append(dict(cf=cf, per_rank=(per_rank / (tokens * top_k)).tolist(),
                                  reference=moe.dropped / (world * tokens * top_k)))
    return out


# ---- the demo ------------------------------------------------------------------------------

def routed_rows(experts, cap, tokens_per_rank: int, n_local: int):
    """n[s, j]: assignments of rank s's tokens that rank j's experts keep, by the reference's
    rule on the concatenated tokens (experts [T_all, k]; first `cap` per expert in token order)."""
    ep = experts.shape[0] // tokens_per_rank
    n = torch.zeros(ep, ep, dtype=torch.long)
    for e in range(int(experts.max()) + 1):
        token = (experts == e).nonzero()[:, 0][:cap]
        n[:, e // n_local] += torch.bincount(token // tokens_per_rank, minlength=ep)
    return n


def _layer_check(cfg, ep_group, rank, world, tokens, device, seed=1):
    """EP layer vs the single-device MoE on all ranks' tokens: max errors, plan, comm counts."""
    ref = build_model(cfg, seed=0, dtype=torch.float64, device=device).layers[0].mlp
    layer = ExpertParallelMoE(copy.deepcopy(ref), ep_group)  # its own copy of the router and experts
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(world * tokens, 1, cfg.dim, generator=g, dtype=torch.float64).to(device)
    dy = torch.randn(world * tokens, 1, cfg.dim, generator=g, dtype=torch.float64).to(device)
    x_ref = x_all.clone().requires_grad_()
    ((ref(x_ref) * dy).sum(-1).mean() + ref.aux_loss).backward()
    sl = slice(rank * tokens, (rank + 1) * tokens)
    x = x_all[sl].clone().requires_grad_()
    with CommCounter() as c:
        out = layer(x)
        ((out * dy[sl]).sum(-1).mean() + layer.aux_loss).backward()
    router_grad = layer.router.weight.grad
    dist.all_reduce(router_grad, group=ep_group)  # the router's gradient: averaged like data parallel
    with torch.no_grad():
        err = max((out - ref(x_all)[sl]).abs().max().item(), abs(layer.aux_loss.item() - ref.aux_loss.item()),
                  (x.grad / world - x_ref.grad[sl]).abs().max().item(),
                  (router_grad / world - ref.router.weight.grad).abs().max().item())
    lo = layer.first
    for p, q in zip(layer.expert_parameters(), (ref.w1, ref.w3, ref.w2)):
        err = max(err, (p.grad / world - q.grad[lo:lo + layer.n_local]).abs().max().item())
    n = routed_rows(ref.route(x_all.view(-1, cfg.dim))[2].cpu(), ref.capacity(world * tokens), tokens, layer.n_local)
    return err, layer, c, n, ref.dropped


def main(argv=None, reference_a2a=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: all ranks)")
    p.add_argument("--capacity-factor", type=float, default=0.75)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank in the layer check")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences) for training")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--compare", action="store_true", help="also run with PyTorch's autograd all-to-all")
    args = p.parse_args(argv)
    device = init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    ep = args.ep or world
    validate_ep(args.experts, args.top_k, ep, args.capacity_factor)  # before any collective
    cfg = get_config(args.model, n_experts=args.experts, top_k=args.top_k)
    Mesh(dp_shard=world, ep=ep)  # raises on every rank if ep does not divide the world
    print0(f"expert parallel: world {world}, ep {ep}, E {cfg.n_experts} ({cfg.n_experts // ep} per rank), "
           f"top-{cfg.top_k}, model {args.model}")
    if ep != world:
        print0("(the layer check uses ep = world; training below uses ep =", ep, ")")
    lines, ok = [], True
    for cf in (None, args.capacity_factor):
        err, layer, c, n, ref_dropped = _layer_check(get_config(args.model, n_experts=args.experts, top_k=args.top_k,
                                                capacity_factor=cf), dist.group.WORLD, rank, world, args.tokens, device)
        worst, dropped = torch.tensor([err], device=device), torch.tensor([layer.dropped], device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        dist.all_reduce(dropped)
        name = "dropless" if cf is None else f"capacity factor {cf}"
        print0(f"[{name}] layer vs single-device MoE on all ranks' tokens (fp64): max |error| of output, "
               f"aux loss and every gradient = {worst.item():.1e}; dropped {dropped.item()} of "
               f"{world * args.tokens * cfg.top_k} assignments (reference: {ref_dropped})")
        plan, rb = layer.plan, layer.plan["row_bytes"]
        # the last four all-to-alls move tokens: dispatch, combine, then their backward (reversed)
        got = [int(e.wire_bytes) for e in c.events if e.op == "all_to_all"][-4:]
        me = plan["me"]  # rows sent to other ranks, from the reference's routing of all tokens
        sent_rows = [int(n[me].sum() - n[me, me]), int(n[:, me].sum() - n[me, me])]
        want = [r * rb for r in sent_rows * 2]
        uniform = args.tokens * cfg.top_k * rb * (world - 1) / world
        ok &= got == want and worst.item() < 1e-9 and dropped.item() == ref_dropped
        lines.append(f"  rank {rank} [{name}]: tokens received per local expert {layer.tokens_per_expert.tolist()}, "
                     f"dropped {layer.dropped}/{args.tokens * cfg.top_k} assignments\n"
                     f"      bytes sent per all-to-all (dispatch, combine, combine-bwd, dispatch-bwd) {got}\n"
                     f"      formula n_sent·H·b for the reference's routing {want} {'ok' if got == want else 'MISMATCH'}; "
                     f"uniform-routing T·k·H·b·(ep-1)/ep = {uniform:.0f}")
    every = [None] * world
    dist.all_gather_object(every, "\n".join(lines))
    print0("\n".join(every))

    # training: the shared model, ep experts per group, against one process on the global batch
    res = train_ep(cfg, ep, args.steps, args.batch, args.seq, device=device)
    runs = [("ours", res)]
    if reference_a2a is not None:
        runs.append(("PyTorch all_to_all_single_autograd", train_ep(cfg, ep, args.steps, args.batch, args.seq,
                                                                    reference_a2a=reference_a2a, device=device)))
    n_full = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    n_experts = cfg.n_layers * 3 * cfg.n_experts * cfg.dim * cfg.ffn_dim
    n_mine = sum(p.numel() for p in res["params"].values())
    ok &= n_mine == n_full - n_experts * (1 - 1 / ep)
    print0(f"parameters per rank {n_mine:,} = all {n_full:,} - (1 - 1/ep) x experts {n_experts:,}: "
           f"{'ok' if n_mine == n_full - n_experts * (1 - 1 / ep) else 'MISMATCH'}")
    if rank == 0:
        model = build_model(cfg, seed=0, device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens, ref, times = load_corpus(), [], []
        for s in range(args.steps):
            x, y = get_batch(tokens, s, args.batch, args.seq, 0, device=device)
            sync(device)
            t0 = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            times.append(time.perf_counter() - t0)
            ref.append(loss.item())
        t_ref = sorted(times[1:] or times)[len(times[1:] or times) // 2]
        print(f"training {args.steps} steps, global batch {args.batch}x{args.seq}, dropless:")
        print(f"  single process losses {[round(v, 6) for v in ref]}  step {t_ref * 1e3:.1f} ms")
        for name, r in runs:
            diff = max(abs(a - b) for a, b in zip(r["losses"], ref))
            ok &= diff < 1e-4
            print(f"  ep={ep} ({name}) losses {[round(v, 6) for v in r['losses']]}  max |diff| {diff:.1e}  "
                  f"step {r['step_time'] * 1e3:.1f} ms ({r['step_time'] / t_ref:.2f}x single process)")
        print(f"  global tokens per expert (layer 0, last step) {[int(v) for v in res['loads'][-1]]}")
        if len(runs) == 2:
            print(f"  step time ours / PyTorch's: {runs[0][1]['step_time'] / runs[1][1]['step_time']:.2f}")
    flag = torch.tensor([float(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    print0("expert parallel matches the single-device model:", "ok" if flag.item() == 1 else "FAILED")
    dist.destroy_process_group()
    if flag.item() != 1:
        raise SystemExit(1)


if __name__ == "__main__":
    import sys
    reference = None
    if "--compare" in sys.argv:
        import torch.distributed._functional_collectives as funcol

        def reference(x, out_splits, in_splits, group):  # PyTorch's differentiable all-to-all
            return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, out_splits, in_splits, group))
    main(reference_a2a=reference)
