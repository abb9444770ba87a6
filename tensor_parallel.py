"""Lesson 4 — tensor parallel (Megatron) and sequence parallel.

The idea
--------
Split every weight matrix of a layer across the t ranks of a tp group. A pair of linears
    Y = (X A) B          X [B, S, H], A [H, F], B [F, H]
needs NO communication between the two matmuls if A is split by COLUMNS (rank r holds
A[:, r-th F/t] and computes its own slice of XA) and B by ROWS (rank r multiplies its slice
of XA by B[r-th F/t, :], a partial sum of Y). One all-reduce adds the partials.
Two conjugate operators make autograd do the right thing (Megatron's f and g):
    f  "copy to tp":       forward identity,   backward all-reduce   (entry of a pair)
    g  "reduce from tp":   forward all-reduce,  backward identity     (exit of a pair)
A transformer block has two pairs — attention (wq, wk, wv column / wo row, split by heads)
and the SwiGLU MLP (w1, w3 column / w2 row) — so per layer
    forward: 2 all-reduces of [B, S, H],   backward: 2 all-reduces of [B, S, H].
The embedding is split by vocabulary (a rank's out-of-range tokens give zeros, then g),
the head by vocabulary too (logits [B, S, V/t] stay split) and the cross-entropy is
computed without gathering the logits: 3 small all-reduces of [B·S] (max, target logit,
sum of exponentials).

Grouped-query attention: heads are split, so kv heads must be too. If t divides n_kv, each
rank keeps n_kv/t kv heads. If n_kv divides t, each kv head is REPLICATED on t/n_kv ranks
(each keeps the one its query heads read); each replica then sees only the gradient of its
own query heads, so those partial gradients are summed after backward (finish_grads).

Sequence parallel (Korthikanti et al.): between the pairs the activations are replicated
under plain TP, so norms and residuals cost full [B, S, H] memory on every rank. Instead
keep them split over the sequence, [B, S/t, H], and replace
    f -> all-gather over S (backward reduce-scatter),  g -> reduce-scatter over S (backward all-gather).
A ring all-reduce IS a reduce-scatter plus an all-gather, so the bytes on the wire are the
same: per rank per collective 2(t-1)/t · BSH·b either way. The norm weights then see only
their shard's tokens: their gradients are summed after backward (finish_grads, one
all-reduce of (2L+1)·H elements per step).

Memory per rank: every matmul weight / t (norms replicated); activations per layer
sbh(10 + 24/t + 5as/(ht)) bytes with TP, sbh/t·(34 + 5as/h) with TP + SP (GPT, fp16).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mesh import Mesh, all_gather_single, init_distributed, print0, reduce_scatter_single
from model import Attention, SwiGLU, build_model, get_config, rope_cos_sin


# ---- the conjugate operators ---------------------------------------------------------------

def _size(group) -> int:
    return dist.get_world_size(group)


class CopyToTP(torch.autograd.Function):
    """f: forward identity, backward all-reduce (every rank's use of x adds to x's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        if _size(ctx.group) > 1:
            g = g.contiguous()
            dist.all_reduce(g, group=ctx.group)
        return g, None


class ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce of the partial sums, backward identity (the sum's gradient is copied)."""

    @staticmethod
    def forward(ctx, x, group):
        if _size(group) > 1:
            x = x.contiguous().clone()  # all_reduce is in place: never overwrite autograd's tensor
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _gather_seq(x, group):
    """[B, S/t, H] -> [B, S, H]: all-gather along the sequence (collectives gather dim 0)."""
    t = _size(group)
    if t == 1:
        return x
    xs = x.transpose(0, 1).contiguous()                       # [S/t, B, H]
    out = xs.new_empty((t * xs.shape[0],) + xs.shape[1:])     # [S, B, H]
    all_gather_single(out, xs, group=group)
    # One contiguous copy: q, k, v (or w1, w3) then save ONE [B, S, H] input between them
    # (a strided view would make each linear save its own flattened copy).
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x, group):
    """[B, S, H] partial sums -> [B, S/t, H]: sum over ranks, keep my sequence shard."""
    t = _size(group)
    if t == 1:
        return x
    xs = x.transpose(0, 1).contiguous()                       # [S, B, H]
    out = xs.new_empty((xs.shape[0] // t,) + xs.shape[1:])    # [S/t, B, H]
    reduce_scatter_single(out, xs, group=group)
    return out.transpose(0, 1)


class GatherFromSP(torch.autograd.Function):
    """SP's f: forward all-gather over S, backward reduce-scatter over S."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_seq(g, ctx.group), None


class ReduceScatterToSP(torch.autograd.Function):
    """SP's g: forward reduce-scatter over S, backward all-gather over S."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_seq(g, ctx.group), None


def enter_tp(x, group, sp: bool):
    """Into a column/row pair: [B, S, H] replicated (f) or [B, S/t, H] gathered (SP)."""
    return GatherFromSP.apply(x, group) if sp else CopyToTP.apply(x, group)


def exit_tp(x, group, sp: bool):
    """Out of a pair: partial [B, S, H] -> summed [B, S, H] (g) or summed [B, S/t, H] (SP)."""
    return ReduceScatterToSP.apply(x, group) if sp else ReduceFromTP.apply(x, group)


# ---- parallel layers ------------------------------------------------------------------------

def _shard(full: torch.Tensor, dim: int, start: int, end: int) -> nn.Parameter:
    """My slice of a full weight, as a fresh parameter that remembers where it came from."""
    p = nn.Parameter(full.detach().narrow(dim, start, end - start).clone())
    p.tp_slice = (dim, start, end)  # for tests and pictures: which part of the full weight
    return p


class ColumnParallelLinear(nn.Module):
    """y[..., rows] = x @ W[rows].T  —  output features split (the output stays split: gather
    it with gather_last_dim to look at it). input_op: "copy" (f), "gather" (SP all-gather) or None
    when the caller already entered the tp region (attention and MLP enter once for all)."""

    def __init__(self, weight, group, rows: tuple[int, int], input_op="copy"):
        super().__init__()
        self.weight = _shard(weight, 0, *rows)                  # [F/t, H]
        self.group, self.input_op = group, input_op

    def forward(self, x):
        if self.input_op is not None:
            x = enter_tp(x, self.group, sp=self.input_op == "gather")
        return F.linear(x, self.weight)                          # [B, S, F/t]


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[..., cols] @ W[:, cols].T  —  input features split (already so)."""

    def __init__(self, weight, group, cols: tuple[int, int], sequence_parallel=False):
        super().__init__()
        self.weight = _shard(weight, 1, *cols)                  # [H, F/t]
        self.group, self.sp = group, sequence_parallel

    def forward(self, x):                                        # x [B, S, F/t]
        return exit_tp(F.linear(x, self.weight), self.group, self.sp)  # [B, S(/t), H]


def gather_last_dim(y, group):
    """[..., F/t] on each rank -> [..., F] (for looking at outputs; not differentiable)."""
    t = _size(group)
    if t == 1:
        return y
    out = y.new_empty((t * y.shape[0],) + y.shape[1:])       # ranks' slices stacked on dim 0
    all_gather_single(out, y.contiguous(), group=group)
    return torch.cat(out.chunk(t, dim=0), dim=-1)


class VocabParallelEmbedding(nn.Module):
    """Rank r owns rows [r·V/t, (r+1)·V/t); other tokens give zeros; the partials are summed."""

    def __init__(self, weight, group, sequence_parallel=False):
        super().__init__()
        t, r = _size(group), dist.get_rank(group)
        V = weight.shape[0]
        self.start, self.end = r * V // t, (r + 1) * V // t
        self.weight = _shard(weight, 0, self.start, self.end)   # [V/t, H]
        self.group, self.sp = group, sequence_parallel

    def forward(self, tokens):                                   # [B, S] (the same on every rank)
        t = _size(self.group)
        if self.sp and tokens.shape[1] % t:  # every rank sees the same tokens: all raise, none hangs
            raise ValueError(f"sequence parallel splits the sequence over tp={t} ranks, but the "
                             f"sequence length is {tokens.shape[1]}: use a multiple of {t}")
        mine = (tokens >= self.start) & (tokens < self.end)
        local = torch.where(mine, tokens - self.start, 0)
        h = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # [B, S, H] partial
        return exit_tp(h, self.group, self.sp)                  # [B, S, H] or [B, S/t, H]


class VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy over logits split by vocabulary, never gathering them.

    loss_i = log sum_v exp(z_iv - m_i) - (z_i,y_i - m_i), m_i = max_v z_iv: three all-reduces
    over the tp group (max, target logit, sum of exponentials) of one number per token.
    Gradient (local, no communication): (softmax_i - onehot(y_i)) / n_valid on my vocab slice.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, ignore_index):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))     # [N, V/t]
        t, Vl = _size(group), z.shape[1]
        m = z.max(dim=-1).values                                            # [N]
        if t > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)           # 1: global max
        z = z - m[:, None]  # the max is a constant: softmax does not depend on it
        local_y = targets - vocab_start
        mine = (local_y >= 0) & (local_y < Vl)                              # my rank owns the target
        idx = torch.where(mine, local_y, 0)
        target_logit = torch.where(mine, z.gather(1, idx[:, None]).squeeze(1), 0.0)
        e = z.exp()
        sum_exp = e.sum(-1)
        if t > 1:
            dist.all_reduce(target_logit, group=group)                      # 2: the target's logit
            dist.all_reduce(sum_exp, group=group)                           # 3: the partition sum
        valid = targets != ignore_index
        n = valid.sum()
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0).sum() / n
        ctx.save_for_backward(e / sum_exp[:, None], idx, mine & valid, valid, n)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, hit, valid, n = ctx.saved_tensors
        # softmax - onehot(target) on the rank owning the target (no host sync: scatter, not indexing)
        grad = softmax.scatter_add(1, idx[:, None], -hit[:, None].to(softmax.dtype))
        grad = grad * (valid[:, None].to(grad.dtype) * (g / n))
        return grad.to(ctx.in_dtype), None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for model.loss_fn: logits [B, S, V/t] (my vocab slice), targets [B, S]."""

    def __init__(self, vocab_start: int, group, ignore_index: int = -100):
        super().__init__()
        self.vocab_start, self.group, self.ignore_index = vocab_start, group, ignore_index

    def forward(self, logits, targets):
        return VocabParallelCE.apply(logits.flatten(0, 1), targets.flatten(), self.vocab_start,
                                     self.group, self.ignore_index)


# ---- the model's blocks, made parallel ---------------------------------------------------------

class ParallelAttention(Attention):
    """model.Attention with wq/wk/wv column-parallel (by heads) and wo row-parallel.

    It reuses Attention.forward: that infers the local head counts from the projections' sizes.
    """

    def __init__(self, attn: Attention, cfg, group, sp: bool):
        nn.Module.__init__(self)
        t, r, hd = _size(group), dist.get_rank(group), attn.head_dim
        self.head_dim, self.sdpa, self.group, self.sp = hd, attn.sdpa, group, sp
        hq = cfg.n_heads // t                                   # my query heads: [r·hq, (r+1)·hq)
        q_rows = (r * hq * hd, (r + 1) * hq * hd)
        if cfg.n_kv_heads % t == 0:                             # kv heads split like the queries
            hkv = cfg.n_kv_heads // t
            kv_rows = (r * hkv * hd, (r + 1) * hkv * hd)
            self.kv_slot = None
        else:                                                   # t/n_kv ranks share one kv head
            j = r // (t // cfg.n_kv_heads)                      # the kv head my query heads read
            kv_rows = (j * hd, (j + 1) * hd)
            self.kv_slot = (j, cfg.n_kv_heads)
        self.wq = ColumnParallelLinear(attn.wq.weight, group, q_rows, input_op=None)
        self.wk = ColumnParallelLinear(attn.wk.weight, group, kv_rows, input_op=None)
        self.wv = ColumnParallelLinear(attn.wv.weight, group, kv_rows, input_op=None)
        self.wo = RowParallelLinear(attn.wo.weight, group, q_rows, sequence_parallel=sp)

    def forward(self, x, cos, sin):                            # x [B, S, H] or [B, S/t, H] (SP)
        # Enter ONCE for q, k and v: one all-reduce (or all-gather) in backward, not three.
        return super().forward(enter_tp(x, self.group, self.sp), cos, sin)


class ParallelSwiGLU(SwiGLU):
    """w2(silu(w1 x) * w3 x) with w1, w3 column-parallel and w2 row-parallel: silu and the
    product are elementwise, so they run on the local F/t slice without communication."""

    def __init__(self, mlp: SwiGLU, group, sp: bool):
        nn.Module.__init__(self)
        t, r = _size(group), dist.get_rank(group)
        Fl = mlp.w1.weight.shape[0] // t
        cols = (r * Fl, (r + 1) * Fl)
        self.w1 = ColumnParallelLinear(mlp.w1.weight, group, cols, input_op=None)
        self.w3 = ColumnParallelLinear(mlp.w3.weight, group, cols, input_op=None)
        self.w2 = RowParallelLinear(mlp.w2.weight, group, cols, sequence_parallel=sp)
        self.group, self.sp = group, sp

    def forward(self, x):
        return super().forward(enter_tp(x, self.group, self.sp))


def check_divisible(cfg, t: int) -> None:
    """Raise ONE clear ValueError (pure arithmetic: on every rank, before any collective)."""
    if cfg.n_experts:
        raise ValueError("tensor_parallel.py splits dense SwiGLU MLPs; for experts use expert "
                         "parallel (n_experts=0 here)")
    # (the hidden size dim = n_heads·head_dim divides whenever n_heads does)
    for what, n in [("n_heads", cfg.n_heads), ("ffn_dim (MLP width)", cfg.ffn_dim),
                    ("vocab_size", cfg.vocab_size)]:
        if n % t:
            ok = [d for d in range(1, n + 1) if n % d == 0 and d <= 64]
            raise ValueError(f"tp={t} does not divide {what}={n}: choose tp from {ok} "
                             f"or change {what.split()[0]}")
    if cfg.n_kv_heads % t and t % cfg.n_kv_heads:
        raise ValueError(f"tp={t} and n_kv_heads={cfg.n_kv_heads}: one must divide the other "
                         f"(split the kv heads, or replicate each on tp/n_kv ranks)")


def apply_tensor_parallel(model, mesh_or_group=None, sequence_parallel: bool = False):
    """Convert the shared model IN PLACE: each rank keeps its slice of the full weights.

    mesh_or_group: a Mesh (its "tp" group is used), a process group, or None (the world).
    model: a model.Transformer, or a pipeline.Stage (layers in a ModuleDict; the embedding,
    final norm and head only on the stages that have them): whatever is present is converted.
    """
    group = mesh_or_group.group("tp") if isinstance(mesh_or_group, Mesh) else mesh_or_group
    group = group if group is not None else dist.group.WORLD
    t, cfg, sp = _size(group), model.cfg, sequence_parallel
    check_divisible(cfg, t)
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings.weight, group, sp)
    partial = []  # (param, slot, n_slots): gradients that are only partial on each rank
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in layers:
        block.attn = ParallelAttention(block.attn, cfg, group, sp)
        block.mlp = ParallelSwiGLU(block.mlp, group, sp)
        if block.attn.kv_slot is not None:
            partial += [(block.attn.wk.weight, *block.attn.kv_slot), (block.attn.wv.weight, *block.attn.kv_slot)]
        if sp:
            partial += [(block.attn_norm.weight, 0, 1), (block.mlp_norm.weight, 0, 1)]
    if getattr(model, "output", None) is not None:
        if sp:
            partial.append((model.norm.weight, 0, 1))
        r, V = dist.get_rank(group), cfg.vocab_size
        rows = (r * V // t, (r + 1) * V // t)
        # The head: enter (f, or all-gather under SP), logits stay split by vocabulary [B, S, V/t].
        model.output = ColumnParallelLinear(model.output.weight, group, rows, input_op="gather" if sp else "copy")
        model.loss_fn = VocabParallelCrossEntropy(rows[0], group)
    model.tp_group, model.tp_partial_grads = group, partial
    return model


def finish_grads(model) -> None:
    """After backward: sum the gradients each rank holds only a part of, in ONE all-reduce.

    Replicated kv heads: a zero-padded [n_kv, ...] buffer per weight, my gradient in my kv
    head's slot; the sum gives each slot the total over the ranks sharing that head.
    SP norms: each rank's gradient covers its tokens only; the sum covers all of them.
    """
    items, group = model.tp_partial_grads, model.tp_group
    if not items or _size(group) == 1:
        return
    bufs = []
    for p, slot, n in items:
        buf = p.new_zeros((n,) + p.shape)
        if p.grad is not None:
            buf[slot] = p.grad
        bufs.append(buf.flatten())
    flat = torch.cat(bufs)
    dist.all_reduce(flat, group=group)
    for (p, slot, n), part in zip(items, flat.split([b.numel() for b in bufs])):
        p.grad = part.view((n,) + p.shape)[slot].clone()


def train_step(model, opt, x, y):
    """One optimizer step of a tensor-parallel model (finish_grads between backward and step)."""
    loss = model(x, y)
    loss.backward()
    if hasattr(model, "tp_partial_grads"):
        finish_grads(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# ---- measurements for the notebook -------------------------------------------------------------

def _saved_activation_bytes(model, cfg, batch, seq):
    """Bytes ONE layer keeps for backward on this rank (once per storage; weights excluded)."""
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    h = model.tok_embeddings(x).detach().requires_grad_()               # [B, S(/t), H]
    cos, sin = rope_cos_sin(torch.arange(seq), cfg.head_dim, cfg.rope_theta, h.dtype)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[0](h, cos, sin)
    return sum(n for ptr, n in saved.items() if ptr not in weights)


def notebook_measurements(model_name="tiny", batch=2, seq=64):
    """For the notebook (run on t ranks): which slice of each weight this rank keeps (layer 0,
    embedding, head), and its parameter and one-layer activation bytes without and with SP."""
    cfg = get_config(model_name)
    out = {}
    for sp in (False, True):
        full = build_model(cfg)
        shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
        m = apply_tensor_parallel(full, None, sequence_parallel=sp)
        out["layout"] = {n: (shapes[n], p.tp_slice) for n, p in m.named_parameters()
                         if hasattr(p, "tp_slice") and not n.startswith("layers.1")}
        out[sp] = dict(params=sum(p.numel() * p.element_size() for p in m.parameters()),
                       activations=_saved_activation_bytes(m, cfg, batch, seq))
    return out


# ---- demo: torchrun --nproc_per_node 2 tensor_parallel.py [--sp] [--no-compare] ------------------
# PyTorch's DTensor TP appears only here, as the reference the demo is timed against.

if __name__ == "__main__":
    def dtensor_tensor_parallel(model, group, sp=False):
        """The same split with DTensor's parallelize_module (torchtitan-style plan)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)
        seq = Shard(1) if sp else Replicate()  # the layout between the pairs
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
                "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
        for i in range(len(model.layers)):
            p = f"layers.{i}."
            plan.update({p + n: ColwiseParallel() for n in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")})
            plan.update({p + n: RowwiseParallel(output_layouts=seq) for n in ("attn.wo", "mlp.w2")})
            if sp:  # norms on the shard; gather once before attention and before the MLP
                plan.update({p + "attn_norm": SequenceParallel(), p + "mlp_norm": SequenceParallel(),
                             p + "attn": PrepareModuleInput(input_layouts=(seq, None, None),
                                                            desired_input_layouts=(Replicate(), None, None)),
                             p + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))})
        if sp:
            plan["norm"] = SequenceParallel()
        return parallelize_module(model, DeviceMesh.from_group(group, device_type=model.output.weight.device.type), plan)

    def main():
        import os

        from data import get_batch, load_corpus
        from instruments import CommCounter
        p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        p.add_argument("--model", default="small", help="tiny | small | ...")
        p.add_argument("--batch", type=int, default=4)
        p.add_argument("--seq", type=int, default=128)
        p.add_argument("--steps", type=int, default=5, help="timed steps per round")
        p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (against noise)")
        p.add_argument("--sp", action="store_true", help="sequence parallel")
        p.add_argument("--no-compare", action="store_true", help="skip PyTorch's DTensor TP")
        args = p.parse_args()
        device = init_distributed()
        t, group = dist.get_world_size(), dist.group.WORLD
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // t))
        cfg = get_config(args.model)
        check_divisible(cfg, t)  # before any collective: a clear error on every rank
        ref = build_model(cfg, seed=0, device=device)
        x, y = get_batch(load_corpus(), 0, args.batch, args.seq, device=device)  # same batch on every rank
        print0(f"tensor parallel: tp={t}, model {args.model}, batch {args.batch}x{args.seq}, "
               f"sequence parallel {'on' if args.sp else 'off'}, {dist.get_backend()} on {device}")

        # 1. Check against the single-process model: loss, logits, every gradient (my slice of it).
        ref_loss = ref(x, y)
        ref_loss.backward()
        mine = apply_tensor_parallel(copy.deepcopy(ref), group, sequence_parallel=args.sp)
        with CommCounter() as fwd:
            loss = mine(x, y)
        with CommCounter() as bwd:
            loss.backward()
        with CommCounter() as fin:
            finish_grads(mine)
        full = dict(ref.named_parameters())
        errs = dict(loss=abs(loss.item() - ref_loss.item()),
                    logits=(gather_last_dim(mine(x).detach(), group) - ref(x)).abs().max().item(),
                    grads=max((q.grad - full[n].grad.narrow(*q.tp_slice[:2], q.tp_slice[2] - q.tp_slice[1])
                               if hasattr(q, "tp_slice") else q.grad - full[n].grad).abs().max().item()
                              for n, q in mine.named_parameters()))
        print0("vs single process: " + ", ".join(f"max |diff| {k} {v:.1e}" for k, v in errs.items()))
        if max(errs.values()) > 1e-4:
            raise SystemExit("tensor-parallel model does NOT match the single-process model")
        L, act = cfg.n_layers, args.batch * args.seq * cfg.dim * 4  # bytes of one [B, S, H] fp32 activation
        print0(f"collectives of one step (L={L} layers; one [B,S,H] = {act / 1e6:.3f} MB):")
        for name, c in (("forward", fwd), ("backward", bwd), ("finish_grads", fin)):
            for op, s in c.summary().items():
                print0(f"  {name:12s} {op:15s} {s['calls']:3d} calls  {s['bytes'] / 1e6:8.3f} MB API  "
                       f"{s['wire_bytes'] / 1e6:8.3f} MB wire")
        print0(f"  expected: forward 1 (embedding) + 2/layer x {L} + 3 (loss) = {2 * L + 4}, backward "
               f"2/layer x {L} + 1 (head) = {2 * L + 1} all-reduces"
               + (" (SP: activation all-reduces -> all-gather + reduce-scatter)" if args.sp else ""))

        def per_layer(model):  # the collectives of ONE block, counted alone
            h = model.tok_embeddings(x).detach().requires_grad_()
            cos, sin = rope_cos_sin(torch.arange(args.seq, device=device), cfg.head_dim, cfg.rope_theta, h.dtype)
            with CommCounter() as f:
                out = model.layers[0](h, cos, sin)
            with CommCounter() as b:
                out.backward(torch.ones_like(out))
            model.zero_grad(set_to_none=True)
            return " | ".join(f"{name}: " + ", ".join(f"{s['calls']} {op}" for op, s in c.summary().items())
                              for name, c in (("forward", f), ("backward", b)))
        print0(f"one layer, by hand:  {per_layer(mine)}")

        # 2. Step time, alternating rounds with PyTorch's DTensor TP on the same model.
        impls = {"by hand" + (" +SP" if args.sp else ""): mine}
        if not args.no_compare and cfg.n_kv_heads % t:
            print0(f"DTensor compare skipped: Colwise would cut n_kv_heads={cfg.n_kv_heads} into {t} pieces")
        elif not args.no_compare:
            dt = dtensor_tensor_parallel(copy.deepcopy(ref), group, sp=args.sp)
            with CommCounter() as dc:
                dl = dt(x, y)
                dl.backward()
            print0(f"DTensor parallelize_module: loss |diff| {abs(dl.item() - ref_loss.item()):.1e}; "
                   + ", ".join(f"{op} {s['calls']} calls {s['wire_bytes'] / 1e6:.3f} MB wire"
                               for op, s in dc.summary().items()))
            print0(f"one layer, DTensor:  {per_layer(dt)}")
            impls["DTensor Colwise/Rowwise" + (" +SP" if args.sp else "")] = dt
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for k, m in impls.items()}
        times = {k: [] for k in impls}
        for _ in range(args.rounds):
            for k, m in impls.items():
                train_step(m, opts[k], x, y)  # warm-up
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    last = train_step(m, opts[k], x, y)
                last.item()
                times[k].append((time.perf_counter() - t0) / args.steps)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        for k, s in med.items():
            print0(f"  {k:26s} {s * 1e3:8.1f} ms/step   {args.batch * args.seq / s:9.0f} tokens/s")
        if len(med) == 2:
            a, b = med.values()
            print0(f"throughput ratio by hand / DTensor: {b / a:.2f}x")
        dist.destroy_process_group()

    main()
