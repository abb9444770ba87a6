"""Lesson 7 — expert parallel: the experts of a mixture of experts live on different ranks.

A mixture-of-experts (MoE) MLP has E experts and a router that sends each token to k of them
(model.py's `MoE` is the single-device reference). Expert parallel (GShard, Lepikhin et al. 2020,
arXiv:2006.16668 §2–3) splits the experts, not the tokens: each of the ep ranks of an "ep" group
holds E/ep experts and keeps its own tokens. Every MoE layer
  1. routes its T tokens: probabilities [T, E], top-k experts and weights [T, k];
  2. exchanges COUNTS first (an all-to-all of [ep, E/ep + 1] integers). An all-to-all with uneven
     splits needs on every rank the exact number of rows each peer will send it: a receiver that
     expects more rows than come waits forever (a hang), one that expects fewer reads the next
     message's rows. So every split used below is a number the sending rank itself produced;
  3. dispatches: sorts its assignments by expert (= by owner rank), one all-to-all of the rows;
  4. runs its local experts, one matmul per expert;
  5. combines: the reverse all-to-all brings each result home, where it is weighted by the router
     and summed into its token. Backward: the same two all-to-alls, splits swapped (AllToAll).
Capacity (Switch Transformer, Fedus et al. 2021, arXiv:2101.03961 §2.2): an expert keeps at most
C = ceil(T_all·k/E·cf) assignments, the first in token order over the ep group's tokens in rank
order; the owner decides and sends its verdict back (a second small all-to-all).
Aux loss (Switch §2.2, eq. 4–6): α·E·Σ_i f_i·P_i, f_i = c_i/(N·k) the share of the N·k assignments
routed to expert i (no gradient), P_i = S_i/N its mean router probability (S_i = Σ_tokens p_i).

Composition (train.py, lesson 8): the tokens of a step may be split over the ranks in any way.
  aux_group  every rank holding other tokens (dp × cp, × tp under tensor parallel); D what data parallel
             divides summed gradients by (dp·cp). A rank differentiates P = S/N + (S_local − sg(S_local))·D/N
             (sg: no gradient): summed and divided by D, the ranks' gradients are the global aux loss's,
             whatever share of the N tokens each holds.
  tp         without sequence parallel the tp ranks hold the same [B, S, H]: each dispatches its 1/tp of the
             rows ONCE and the outputs are all-gathered (SplitRows); with it the rows already differ. Either
             way router and expert gradients are partial sums over tp. cp: an ep group is ep dp ranks at one
             cp index. Micro-batches, pipeline stages: the aux loss is per forward call, over its tokens (as
             Megatron-LM); aux_weight=w (1/m) makes a stage output's backward carry w·∂aux (AuxInBackward).
  gradients  dense: sum over dp × cp, divide by D. Experts: the backward all-to-all already summed every ep
             rank's contribution on the owner; sum over the other copies ("edp_cp": dp/ep × cp ranks) and
             divide by D too — not by |edp_cp|, which would count each loss ep times. Under tp: first over tp.

Communication per MoE layer and forward, per rank (b bytes per element; all-to-all: bytes sent to
OTHER ranks; all-reduce, all-gather: ring wire bytes, see mesh.py):
    counts     ep·(E/ep + 1) int64 (+ ep·E/ep back with a capacity)
    aux        one all-reduce of 2E + 1 float64 over aux_group
    dispatch   Σ_{j≠me} n_j·H·b, n_j my kept assignments to rank j; uniform routing T·k·H·b·(ep−1)/ep
    combine    the same rows back; backward: both again
    tp split   all-gather of the output [T, H], in backward of the input gradient: (tp−1)/tp·T·H·b each
Per step (Ψ_E expert elements of the model, n_e = dp·cp/ep ranks holding each copy): the expert gradients,
Ψ_E/ep·b API bytes, all-reduced over edp_cp (or ZeRO's collectives there, fsdp.py). Memory per rank for the
experts: fsdp.py's model state (lesson 2) of Ψ_E/ep elements, ZeRO over edp_cp dividing its sharded terms by
n_e; not divided by tp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp import average_gradients
from lab.model import MoE
from mesh import all_gather_single, all_reduce_flat


# ---- the differentiable all-to-all -----------------------------------------------------------

def _all_to_all(x, out_splits, in_splits, group):
    """Rows x[sum(in_splits[:j]) : +in_splits[j]] go to rank j; out_splits[i] rows arrive from rank i."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """The forward permutes the rows of the whole group. A permutation's gradient is the inverse
    permutation: each row's gradient goes back to where the row came from — splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.splits, ctx.group), None, None, None


# ---- the layer: dispatch, my experts, combine -----------------------------------------------------

class ExpertParallelMoE(MoE):
    """model.MoE with its E experts spread over `ep_group`, E/ep per rank (a subclass: Transformer.aux_loss()
    still adds its aux loss); sets aux_loss, tokens_per_expert [E/ep] and dropped, as MoE does. The core is
    dispatch_combine: route, exchange counts, dispatch by all-to-all, my experts, combine by all-to-all. Alone
    on one group its aux loss counts the ep group's tokens; what the composition adds — the aux group, the
    gradient divisor, tensor parallel's token split, the aux loss riding on a pipeline stage's backward —
    parallelize_experts sets with compose()."""

    all_to_all = staticmethod(AllToAll.apply)  # (the demo's --compare swaps in PyTorch's on one layer)

    def __init__(self, moe: MoE, ep_group):
        nn.Module.__init__(self)  # not MoE.__init__: that would allocate all E experts
        ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)  # local lookups
        validate_ep(moe.n_experts, moe.top_k, ep, moe.capacity_factor)    # before any collective
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.capacity_factor, self.aux_loss_coef = moe.capacity_factor, moe.aux_loss_coef
        self.ep_group, self.ep, self.n_local = ep_group, ep, moe.n_experts // ep
        self.first = rank * self.n_local                     # my experts: first .. first + E/ep - 1
        self.router = moe.router                             # replicated on every rank
        sl = slice(self.first, self.first + self.n_local)
        self.w1, self.w3, self.w2 = (None if w is None else nn.Parameter(w.detach()[sl].clone())
                                     for w in (moe.w1, moe.w3, moe.w2))   # (GELU experts: no w3)
        self.approximate = moe.approximate
        for p in self.expert_parameters():  # [E/ep, F, H], [E/ep, F, H], [E/ep, H, F]: my rows of the full
            p.ep_slice = (0, sl.start, sl.stop)  # [E, ...] stacks (to materialise a meta model's slice by name)
        self.aux_loss, self.tokens_per_expert, self.dropped = None, None, 0
        self.compose()

    def forward(self, x):                                    # [B, S, H] (sequence parallel: [B, S/tp, H])
        shape, T = x.shape, x.shape[:-1].numel()
        x = x.reshape(T, -1)                                 # [T, H]
        if self.split_tokens:                                # the tp ranks hold the same T tokens:
            x = SplitRows.apply(x, T, self.tp_group, True)   # [T/tp, H] mine, dispatched once
        out = self.dispatch_combine(x)
        if self.split_tokens:
            out = SplitRows.apply(out, T, self.tp_group, False)  # [T, H] on every tp rank
        return out.view(shape)

    def dispatch_combine(self, x):                           # [T, H] -> [T, H]
        T, k, n_local, ep = x.shape[0], self.top_k, self.n_local, self.ep
        probs, weights, experts, _ = self.route(x)           # the reference router: [T,E], [T,k], [T,k]
        flat = experts.flatten()                             # [T·k] expert of assignment a = t·k + slot
        counts = torch.bincount(flat, minlength=self.n_experts)  # [E]
        aux = self.group_aux_loss(probs, counts)
        keep_send, keep_recv = self.exchange_counts(counts, T)   # every split agreed before a row moves

        # Sort assignments by expert (stable: token order within an expert, as the reference keeps
        # them), then keep the first keep_send[e] of each expert's queue.
        order = torch.argsort(flat, stable=True)             # [T·k]
        sorted_e = flat[order]
        pos = torch.arange(T * k, device=x.device) - (counts.cumsum(0) - counts)[sorted_e]
        sel = order[pos < keep_send[sorted_e]]               # [N_send] kept, grouped by owner rank
        tok = torch.div(sel, k, rounding_mode="floor")       # their tokens
        send = keep_send.view(ep, n_local).sum(1).tolist()        # rows to each rank
        recv = keep_recv.sum(1).tolist()                     # rows from each rank

        # dispatch: rows arrive grouped by source rank, then by my expert, in token order
        rows = self.all_to_all(x[tok], recv, send, self.ep_group)               # [N_recv, H]
        row_expert = torch.arange(n_local, device=x.device).repeat(ep).repeat_interleave(keep_recv.flatten())
        perm = torch.argsort(row_expert, stable=True)        # expert-major: one matmul per expert
        ys = self.experts(rows[perm].split(keep_recv.sum(0).tolist()))
        y = torch.cat(ys)[torch.argsort(perm)]               # back to arrival order [N_recv, H]

        # combine: results go home (splits swapped), are weighted and summed into their tokens
        back = self.all_to_all(y, send, recv, self.ep_group)                    # [N_send, H]
        out = torch.zeros_like(x).index_add(0, tok, back * weights.flatten()[sel, None])
        if self.aux_weight is not None:                      # the aux loss rides on the output's backward
            out, aux = AuxInBackward.apply(out, aux, self.aux_weight), aux.detach()
        self.aux_loss, self.tokens_per_expert, self.dropped = aux, keep_recv.sum(0), T * k - len(sel)
        return out

    def expert_parameters(self):
        return [w for w in (self.w1, self.w3, self.w2) if w is not None]

    def compose(self, aux_group=None, grad_divisor=None, tp_group=None, sequence_parallel: bool = False,
                aux_weight: float | None = None) -> None:
        """What the composition sets (the module doc's Composition): aux_group (default: the ep group), grad_divisor
        D (default |aux_group|/tp), tp_group (its ranks hold the same tokens unless sequence_parallel: each
        dispatches 1/tp of them) and aux_weight w (None: the model adds aux_loss to its loss; a number: the
        output's backward carries w·∂aux and aux_loss is only a value)."""
        self.aux_group = aux_group if aux_group is not None else self.ep_group
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_group, self.split_tokens = (tp_group if tp > 1 else None), tp > 1 and not sequence_parallel
        self.grad_divisor = grad_divisor or dist.get_world_size(self.aux_group) // tp
        self.aux_weight = aux_weight

    def group_aux_loss(self, probs, counts):
        """Switch's α·E·Σ f_i·P_i over every token of aux_group: one all-reduce of [c, S, N] (float64:
        counts stay exact). Gradient only through my S_local, times D/N (see the module doc)."""
        E, S_local = self.n_experts, probs.sum(0)            # [E]
        stats = torch.cat([counts.double(), S_local.detach().double(), S_local.new_tensor([len(probs)]).double()])
        dist.all_reduce(stats, group=self.aux_group)         # [2E + 1] global sums
        c, S, N = stats[:E], stats[E:2 * E], stats[2 * E]
        f = (c / (N * self.top_k)).to(probs.dtype)
        P = (S / N).to(probs.dtype) + (S_local - S_local.detach()) * (self.grad_divisor / N.item())
        return self.aux_loss_coef * E * (f * P).sum()

    def exchange_counts(self, counts, T):
        """counts [E] my assignments per expert -> keep_send [E] (how many each expert accepts) and
        keep_recv [ep, E/ep] (rows I get from each rank for each of my experts). Dropless: what I get
        from rank s IS what s counted. Capacity: the owner alone decides, from every sender's counts,
        and its verdict travels back to the sender. No rank ever guesses another rank's numbers."""
        ep, n_local = self.ep, self.n_local
        msg = torch.cat([counts.view(ep, n_local), counts.new_full((ep, 1), T)], 1)  # row j: for rank j, + my T
        got = _all_to_all(msg, [1] * ep, [1] * ep, self.ep_group)             # row s: from rank s
        recv = got[:, :n_local]                                                      # [ep, n_local]
        cap = self.capacity(int(got[:, n_local].sum()))           # C over the ep group's T_all tokens
        if cap is None:
            return counts, recv
        before = recv.cumsum(0) - recv                       # assignments to e from lower ranks
        keep_recv = torch.minimum((cap - before).clamp(min=0), recv)            # first C, rank-major
        keep_send = _all_to_all(keep_recv, [1] * ep, [1] * ep, self.ep_group)   # row j: j's verdict
        return keep_send.reshape(-1), keep_recv


# ---- tokens that tensor parallel replicates: split once, gather after -------------------------

def _gather_rows(x, T, group):
    """Rank r's rows (torch.tensor_split's r-th chunk of T) -> all T rows on every rank."""
    tp = dist.get_world_size(group)
    sizes = [T // tp + (r < T % tp) for r in range(tp)]
    buf = x.new_empty((tp * sizes[0],) + tuple(x.shape[1:]))  # chunks padded to one size
    all_gather_single(buf, F.pad(x, (0, 0, 0, sizes[0] - x.shape[0])).contiguous(), group=group)
    return torch.cat([c[:s] for c, s in zip(buf.view(tp, sizes[0], -1), sizes)])


def _my_rows(x, group):
    return x.tensor_split(dist.get_world_size(group))[dist.get_rank(group)]


class SplitRows(torch.autograd.Function):
    """split=True: forward keeps my 1/tp of the rows, backward all-gathers every rank's row gradients.
    split=False, the mirror: forward all-gathers the rows, backward keeps my rows of the gradient
    (the gradient of an activation tp replicates is already whole on every tp rank: no sum)."""

    @staticmethod
    def forward(ctx, x, T, group, split):
        ctx.T, ctx.group, ctx.split = T, group, split
        return _my_rows(x, group).clone() if split else _gather_rows(x, T, group)

    @staticmethod
    def backward(ctx, grad):
        return (_gather_rows(grad, ctx.T, ctx.group) if ctx.split else _my_rows(grad, ctx.group)), None, None, None


class AuxInBackward(torch.autograd.Function):
    """Return `out` unchanged; its backward also backpropagates w·aux (Megatron-LM's
    MoEAuxLossAutoScaler): a pipeline stage's backward starts from its output's gradient."""

    @staticmethod
    def forward(ctx, out, aux, w):
        ctx.w, ctx.dtype = w, aux.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.w, dtype=ctx.dtype, device=grad.device), None


# ---- a model's experts: sizes, swapping, gradients ---------------------------------------------

def validate_ep(n_experts: int, top_k: int, ep: int, capacity_factor=None) -> None:
    """Raise ValueError on sizes expert parallel cannot run — pure arithmetic, no collective."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be an integer >= 1, got {ep!r}")
    if n_experts < 1 or n_experts % ep:
        divisors = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
        raise ValueError(f"n_experts={n_experts} is not divisible by ep={ep}: every rank must hold as many experts; "
                         f"choose ep from {divisors} or E a multiple of {ep}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}: a token has at most E experts")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None for dropless)")


def parallelize_experts(model, mesh, *, sequence_parallel: bool = False, aux_weight: float | None = None):
    """Swap every MoE of a model.Transformer or a pipeline.Stage (layers in a ModuleDict) for its expert-parallel
    layer, in place; returns the model. From the Mesh: its "ep" group; the aux group spans every rank holding
    distinct tokens (dp × cp, × tp when tp > 1); D = dp·cp; tokens split over tp unless sequence_parallel."""
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    blocks = [b for b in layers if isinstance(b.mlp, MoE) and not isinstance(b.mlp, ExpertParallelMoE)]
    for b in blocks:  # every layer validated before any is touched, and before any collective
        validate_ep(b.mlp.n_experts, b.mlp.top_k, mesh.size("ep"), b.mlp.capacity_factor)
    aux, tp = mesh.group("dp_cp"), mesh.size("tp")
    if tp > 1:  # the tokens differ over tp too: a dp × cp × tp group (every rank builds every group, in order)
        for ranks in mesh.groups_along(("dp_replicate", "dp_shard", "cp", "tp")):
            group = dist.new_group(ranks)
            aux = group if mesh.global_rank in ranks else aux
    for b in blocks:
        b.mlp = ExpertParallelMoE(b.mlp, mesh.group("ep"))
        b.mlp.compose(aux, mesh.size("dp_cp"), mesh.group("tp") if tp > 1 else None, sequence_parallel, aux_weight)
    return model


def expert_parameters(model) -> list:
    """Every expert weight: replicated over "edp_cp" (ZeRO shards them there), gradient divisor dp·cp."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.expert_parameters()]


def tp_partial_parameters(model) -> list:
    """Router and expert weights under tp: each tp rank saw only its tokens, so their gradients are
    partial sums, to be summed over tp (tensor_parallel's partial-gradient list can hold them)."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE) and m.tp_group is not None
            for p in m.parameters()]


def sync_gradients(model, dp_group, edp_group, divide_by: int, tp_group=None) -> None:
    """Make every gradient the mean over the data-parallel ranks' losses: dense gradients summed over
    dp_group (dp × cp), expert gradients over edp_group ("edp", or "edp_cp" with cp), both divided by
    divide_by = dp·cp (see the module doc for why experts too) — lesson 1's average twice, on two groups.
    tp_group: sum the tp-partial ones first."""
    expert = {id(p) for p in expert_parameters(model)}
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # every rank must hand the all-reduces the same sizes
            p.grad = torch.zeros_like(p)
    if tp_group is not None:
        all_reduce_flat([p.grad for p in tp_partial_parameters(model)], tp_group)
    average_gradients([p for p in params if id(p) not in expert], dp_group, divide_by)
    average_gradients([p for p in params if id(p) in expert], edp_group, divide_by)


if __name__ == "__main__":  # the demo (the layer against the single-device MoE, training, bytes) is in the package
    from lab.expert_parallel_demo import main
    main()
