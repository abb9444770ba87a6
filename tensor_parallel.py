"""Lesson 4 — tensor parallel (Megatron) and sequence parallel.

Split every weight matrix of a layer over the t ranks of a tp group (Shoeybi et al. 2019, Megatron-LM,
arXiv:1909.08053 §3). A pair of linears Y = (X A) B needs no communication between its matmuls if A is
cut by COLUMNS (rank r computes its own F/t features of XA) and B by ROWS (rank r multiplies them by its
F/t rows of B: a partial sum of Y); one all-reduce adds the partials. Two conjugate operators make
autograd right (Megatron's f and g, §3 Figure 3): f at the entry of a pair (forward identity, backward
all-reduce), g at its exit (forward all-reduce, backward identity). A block has two pairs, attention
(wq, wk, wv by heads / wo) and the SwiGLU MLP (w1, w3 / w2); the embedding and the head are cut by
vocabulary, and the cross-entropy never gathers the logits (3 all-reduces of one number per token, §3).
GQA: if t divides n_kv a rank keeps n_kv/t kv heads; if n_kv divides t each kv head is replicated on
the t/n_kv ranks whose query heads read it, and its gradient there is partial.
Sequence parallel (Korthikanti et al. 2022, arXiv:2205.05198 §4.2.2): between the pairs, keep the
activations (norms, residuals) as [B, S/t, H] instead of whole [B, S, H] on every rank: f becomes an
all-gather over S (backward reduce-scatter), g a reduce-scatter (backward all-gather); the norm weights
then see S/t tokens and their gradients are partial too. finish_grads sums partial gradients over tp.
GPT-family options (lab/model.py): a column-parallel linear's bias is cut with its rows (each rank adds its F/t);
a row-parallel one's is whole on every rank and added once, after the sum (under SP to my S/t tokens: partial,
like the norms' weights and LayerNorm's biases); GPT's GELU MLP is a pair like SwiGLU's; ALiBi's slopes follow my
query heads; learned positions stay whole (under SP each rank adds the rows of its S/t tokens: partial); a tied
head takes the embedding's slice itself (the same rows); a padded vocabulary's extra logits are masked in the loss.

One step, L layers, b bytes per element (API bytes handed to the collectives; [ring wire bytes per rank]):
    TP   4L + 2 all-reduces of B·S·H·b                             [2(t-1)/t of each]
    SP   4L + 2 all-gathers + 4L + 2 reduce-scatters of B·S·H·b     [(t-1)/t of each]: the same wire bytes
    (+2: the embedding's g forward, the head's f backward; the loss: 3 all-reduces of B·S·max(b, 4))
    finish_grads: one all-reduce of 2L·n_kv·(H/n_heads)·H elements if t > n_kv (replicated kv weights,
    each zero-padded to n_kv slots) + (2L + 1)·H with SP (the norm weights).
Memory per rank: matmul weights / t, the kv projections / min(t, n_kv), norms replicated. Activations of
one layer (Korthikanti §4.2; their s sequence, b batch, h hidden, a heads; 16-bit bytes):
    TP  sbh(10 + 24/t + 5as/(ht))          TP + SP  sbh/t·(34 + 5as/h)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mesh import all_gather_single, all_reduce_flat, reduce_scatter_single, resolve_group
from lab.model import IGNORE, ALiBi, Attention, GeluMLP, LayerNorm, RMSNorm, SwiGLU


# ---- the conjugate operators f and g --------------------------------------------------------------

def _all_reduce(x, group):
    x = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place: not on autograd's tensor
    dist.all_reduce(x, group=group)
    return x


def _gather_seq(x, group):                                 # [B, S/t, H] -> [B, S, H]
    xs = x.transpose(0, 1).contiguous()                    # [S/t, B, H]: collectives concatenate dim 0
    out = xs.new_empty((dist.get_world_size(group) * xs.shape[0],) + xs.shape[1:])
    all_gather_single(out, xs, group=group)
    return out.transpose(0, 1).contiguous()  # contiguous: q, k, v then save ONE input, not a copy each


def _reduce_scatter_seq(x, group):                         # [B, S, H] partial -> [B, S/t, H] summed
    xs = x.transpose(0, 1).contiguous()                    # [S, B, H]
    out = xs.new_empty((xs.shape[0] // dist.get_world_size(group),) + xs.shape[1:])
    reduce_scatter_single(out, xs, group=group)
    return out.transpose(0, 1)


class _Conjugate(torch.autograd.Function):
    """forward: fwd(x); backward: bwd(grad)."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group) if dist.get_world_size(group) > 1 else x

    @staticmethod
    def backward(ctx, grad):
        return (ctx.bwd(grad, ctx.group) if dist.get_world_size(ctx.group) > 1 else grad), None, None, None


def _identity(x, group):
    return x


#      forward               backward
F_TP = (_identity,           _all_reduce)           # f: every rank's use of x adds to x's gradient
G_TP = (_all_reduce,         _identity)             # g: the sum's gradient is copied to every part
F_SP = (_gather_seq,         _reduce_scatter_seq)   # SP's f: [B, S/t, H] in, [B, S, H] out
G_SP = (_reduce_scatter_seq, _gather_seq)           # SP's g: [B, S, H] partial in, [B, S/t, H] out


def enter_tp(x, group, sp: bool):   # into a column/row pair: f, or SP's all-gather
    return _Conjugate.apply(x, group, *(F_SP if sp else F_TP))


def exit_tp(x, group, sp: bool):    # out of a pair: g, or SP's reduce-scatter
    return _Conjugate.apply(x, group, *(G_SP if sp else G_TP))


# ---- column- and row-parallel linears -------------------------------------------------------------

def _shard(full: torch.Tensor, dim: int, start: int, end: int) -> nn.Parameter:
    """My slice of a full weight, as a new parameter that remembers where it came from."""
    p = nn.Parameter(full.detach().narrow(dim, start, end - start).clone())
    p.tp_slice = (dim, start, end)
    return p


def full_slice(full: torch.Tensor, p) -> torch.Tensor:
    """The part of a full tensor (a weight, its gradient) that parameter p holds."""
    return full.narrow(p.tp_slice[0], p.tp_slice[1], p.tp_slice[2] - p.tp_slice[1]) if hasattr(p, "tp_slice") else full


class ColumnParallelLinear(nn.Module):
    """y = x @ W[rows].T, my output features [..., F/t]. input_op: "copy" (f), "gather" (SP's f), or
    None when the caller entered the pair already (attention and the MLP enter once for all)."""

    def __init__(self, weight, group, rows: tuple[int, int], input_op="copy"):
        super().__init__()
        self.weight, self.group, self.input_op = _shard(weight, 0, *rows), group, input_op   # [F/t, H]

    # The local matmul, named so that other lessons can swap it on one layer without forking this class:
    # float8 training (lab.model.use_float8) makes it a float8 matmul, and zero bubble (pipeline.split_linears)
    # one whose backward leaves the weight's gradient for later. Here it is plain F.linear.
    linear = staticmethod(F.linear)

    def forward(self, x):
        if self.input_op is not None:
            x = enter_tp(x, self.group, sp=self.input_op == "gather")
        return self.linear(x, self.weight)                              # [B, S, F/t]


class RowParallelLinear(nn.Module):
    """y = Σ over ranks of x[..., my F/t] @ W[:, my F/t].T, then g (the input is split already)."""

    def __init__(self, weight, group, cols: tuple[int, int], sequence_parallel=False):
        super().__init__()
        self.weight, self.group, self.sp = _shard(weight, 1, *cols), group, sequence_parallel   # [H, F/t]

    linear = staticmethod(F.linear)  # (swappable, as ColumnParallelLinear's)

    def forward(self, x):                                                # [B, S, F/t]
        return exit_tp(self.linear(x, self.weight), self.group, self.sp)   # [B, S, H] or [B, S/t, H]


# ---- biases, for the GPT-family options: around the pair, never inside it --------------------------

class ColumnParallelLinearWithBias(ColumnParallelLinear):
    """ColumnParallelLinear plus my F/t rows of the bias, cut like the weight's rows."""

    def __init__(self, weight, bias, group, rows: tuple[int, int], input_op="copy"):
        super().__init__(weight, group, rows, input_op)
        self.bias = _shard(bias, 0, *rows)                                   # [F/t]

    def forward(self, x):
        return super().forward(x) + self.bias


class RowParallelLinearWithBias(RowParallelLinear):
    """RowParallelLinear plus the whole bias, added once after the sum (added before it, t ranks would add it t
    times). Every rank holds it; its gradient is whole on every rank, or under SP partial (my S/t tokens)."""

    def __init__(self, weight, bias, group, cols: tuple[int, int], sequence_parallel=False):
        super().__init__(weight, group, cols, sequence_parallel)
        self.bias = nn.Parameter(bias.detach().clone())                      # [H]

    def forward(self, x):
        return super().forward(x) + self.bias


def column_parallel(linear: nn.Linear, group, rows, input_op="copy"):
    """An nn.Linear (its bias, if any, too) as a ColumnParallelLinear of my rows."""
    if linear.bias is None:
        return ColumnParallelLinear(linear.weight, group, rows, input_op)
    return ColumnParallelLinearWithBias(linear.weight, linear.bias, group, rows, input_op)


def row_parallel(linear: nn.Linear, group, cols, sequence_parallel=False):
    """An nn.Linear (its bias, if any, too) as a RowParallelLinear of my columns."""
    if linear.bias is None:
        return RowParallelLinear(linear.weight, group, cols, sequence_parallel)
    return RowParallelLinearWithBias(linear.weight, linear.bias, group, cols, sequence_parallel)


# ---- the model's layers, made parallel -----------------------------------------------------------

class VocabParallelEmbedding(nn.Module):
    """Rank r owns rows [r·V/t, (r+1)·V/t); other tokens give zeros; g sums the partials."""

    def __init__(self, weight, group, sequence_parallel=False):
        super().__init__()
        t, r, V = dist.get_world_size(group), dist.get_rank(group), weight.shape[0]
        self.start, self.end = r * V // t, (r + 1) * V // t
        self.weight, self.group, self.sp = _shard(weight, 0, self.start, self.end), group, sequence_parallel

    def forward(self, tokens):                                           # [B, S], the same on every rank
        t = dist.get_world_size(self.group)
        if self.sp and tokens.shape[1] % t:  # every rank sees the same tokens: all raise, none hangs
            raise ValueError(f"sequence parallel splits the sequence over tp={t} ranks, but the "
                             f"sequence length is {tokens.shape[1]}: use a multiple of {t}")
        mine = (tokens >= self.start) & (tokens < self.end)
        h = F.embedding(torch.where(mine, tokens - self.start, 0), self.weight)
        return exit_tp(h * mine.unsqueeze(-1).to(h.dtype), self.group, self.sp)  # [B, S(/t), H]


class ParallelAttention(Attention):
    """model.Attention with wq, wk, wv column-parallel (by heads) and wo row-parallel. Its forward is
    Attention.forward, which takes the local head counts from the projections' sizes."""

    def __init__(self, attn: Attention, cfg, group, sp: bool):
        nn.Module.__init__(self)
        t, r, hd = dist.get_world_size(group), dist.get_rank(group), attn.head_dim
        self.head_dim, self.sdpa, self.group, self.sp = hd, attn.sdpa, group, sp
        # my query heads [r·hq, (r+1)·hq); my kv heads [j, j + hkv): split like the queries if t divides
        # n_kv, else kv head j is replicated on the t/n_kv ranks whose query heads read it (slot j)
        hq, hkv, j = cfg.n_heads // t, max(cfg.n_kv_heads // t, 1), r * cfg.n_kv_heads // t
        q_rows, kv_rows = (r * hq * hd, (r + 1) * hq * hd), (j * hd, (j + hkv) * hd)
        self.kv_slot = (j, cfg.n_kv_heads) if t > cfg.n_kv_heads else None
        # input_op=None: forward enters the pair ONCE for q, k and v (one all-reduce in backward, not 3)
        self.wq, self.wk, self.wv = (column_parallel(w, group, rows, input_op=None)
                                     for w, rows in ((attn.wq, q_rows), (attn.wk, kv_rows), (attn.wv, kv_rows)))
        self.wo = row_parallel(attn.wo, group, q_rows, sequence_parallel=sp)
        if isinstance(attn.sdpa, ALiBi):  # my query heads' slopes
            self.sdpa = ALiBi(attn.sdpa.n_heads, attn.sdpa.first + r * hq)

    def forward(self, x, cos, sin):                            # x [B, S, H] or [B, S/t, H] (SP)
        S = x.shape[1] * (dist.get_world_size(self.group) if self.sp else 1)
        if cos is not None and cos.shape[0] != S:  # shapes every rank shares: all raise, before the all-gather
            raise ValueError(f"rotary positions cover {cos.shape[0]} tokens but attention sees {S}: under "
                             f"sequence parallel a pipeline stage's input holds S/tp tokens; give the stage "
                             f"the positions of all S (stage.positions = torch.arange(S))")
        return super().forward(enter_tp(x, self.group, self.sp), cos, sin)


class ParallelSwiGLU(SwiGLU):
    """w2(silu(w1 x) * w3 x) with w1, w3 column-parallel and w2 row-parallel: silu and the product are
    elementwise, so they run on my F/t features without communication."""

    def __init__(self, mlp: SwiGLU, group, sp: bool):
        nn.Module.__init__(self)
        f, r = mlp.w1.weight.shape[0] // dist.get_world_size(group), dist.get_rank(group)
        self.w1, self.w3 = (ColumnParallelLinear(w.weight, group, (r * f, r * f + f), input_op=None)
                            for w in (mlp.w1, mlp.w3))
        self.w2 = RowParallelLinear(mlp.w2.weight, group, (r * f, r * f + f), sequence_parallel=sp)
        self.group, self.sp = group, sp

    def forward(self, x):
        return super().forward(enter_tp(x, self.group, self.sp))


class ParallelGeluMLP(GeluMLP):
    """GPT's w2(gelu(w1 x)) with w1 column-parallel and w2 row-parallel (biases with them): gelu is elementwise."""

    def __init__(self, mlp: GeluMLP, group, sp: bool):
        nn.Module.__init__(self)
        f, r = mlp.w1.weight.shape[0] // dist.get_world_size(group), dist.get_rank(group)
        self.w1 = column_parallel(mlp.w1, group, (r * f, r * f + f), input_op=None)
        self.w2 = row_parallel(mlp.w2, group, (r * f, r * f + f), sequence_parallel=sp)
        self.approximate, self.group, self.sp = mlp.approximate, group, sp

    def forward(self, x):
        return super().forward(enter_tp(x, self.group, self.sp))


class SequenceParallelPositions(nn.Module):
    """Learned positions under sequence parallel: the whole table on every rank, each rank looking up the rows of
    its S/t tokens (the sequence's t-th part it holds after the embedding's reduce-scatter); its gradient is then
    partial. positions: those of all the S tokens this rank's sequence holds (a cp shard's)."""

    def __init__(self, weight, group):
        super().__init__()
        self.weight, self.group = weight, group

    def forward(self, positions):                                        # [S] -> [S/t, H]
        return F.embedding(positions.tensor_split(dist.get_world_size(self.group))[dist.get_rank(self.group)],
                           self.weight)


class VocabParallelCE(torch.autograd.Function):
    """Cross-entropy of logits [N, V/t] (my vocabulary slice), never gathering them:
    loss_i = log Σ_v exp(z_iv − m_i) − (z_{i,y_i} − m_i), m_i = max_v z_iv. divide_by None: the mean over
    the counted targets (not IGNORE); a number: their sum / divide_by. The gradient is local:
    (softmax − onehot(y)) / divisor on my slice."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, divide_by):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))      # [N, V/t]
        m, t = z.max(dim=-1).values, dist.get_world_size(group)              # [N]
        if t > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)             # 1: the max over all V
        z = z - m[:, None]                            # a constant per row: the softmax does not change
        local = targets - vocab_start
        mine = (local >= 0) & (local < z.shape[1])                            # I hold the target's logit
        idx = torch.where(mine, local, 0)
        target_logit = torch.where(mine, z.gather(1, idx[:, None]).squeeze(1), 0.0)
        e = z.exp()
        sum_exp = e.sum(-1)
        if t > 1:
            dist.all_reduce(target_logit, group=group)                        # 2: the target's logit
            dist.all_reduce(sum_exp, group=group)                             # 3: the partition sum
        valid = targets != IGNORE
        ctx.n = valid.sum() if divide_by is None else divide_by
        ctx.save_for_backward(e / sum_exp[:, None], idx, mine & valid, valid)
        ctx.in_dtype = logits.dtype
        return torch.where(valid, sum_exp.log() - target_logit, 0.0).sum() / ctx.n

    @staticmethod
    def backward(ctx, g):
        softmax, idx, hit, valid = ctx.saved_tensors
        grad = softmax.scatter_add(1, idx[:, None], -hit[:, None].to(softmax.dtype))  # − onehot, no host sync
        return (grad * (valid[:, None].to(grad.dtype) * (g / ctx.n))).to(ctx.in_dtype), None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """In place of model.CrossEntropy: logits [B, S, V/t], targets [B, S]; divide_by as there."""

    def __init__(self, vocab_start: int, group, vocab_size: int | None = None):
        super().__init__()
        self.vocab_start, self.group, self.divide_by = vocab_start, group, None
        self.vocab_size = vocab_size  # a padded vocabulary's true size: the columns from it on are masked

    def forward(self, logits, targets):
        if self.vocab_size is not None and self.vocab_start + logits.shape[-1] > self.vocab_size:
            padded = torch.arange(logits.shape[-1], device=logits.device) >= self.vocab_size - self.vocab_start
            logits = logits.masked_fill(padded, float("-inf"))  # softmax 0, gradient 0: as if the rows were not there
        return VocabParallelCE.apply(logits.flatten(0, 1), targets.flatten(), self.vocab_start, self.group,
                                     self.divide_by)


# ---- the whole model ---------------------------------------------------------------------------------

def check_divisible(cfg, t: int) -> None:
    """Raise ONE clear ValueError naming every size tp cannot split (arithmetic only: on every rank, before
    any collective). A mixture of experts' MLP is not split (expert parallel dispatches its tokens)."""
    vocab = ("vocab_size", cfg.vocab_size) if cfg.padded_vocab == cfg.vocab_size else \
        (f"vocabulary padded to vocab_multiple={cfg.vocab_multiple}", cfg.padded_vocab)
    sizes = [("n_heads", cfg.n_heads), vocab]
    sizes += [] if cfg.n_experts else [("ffn_dim (MLP width)", cfg.ffn_dim)]
    problems = []
    for what, n in sizes:
        if n % t:  # (the hidden size n_heads·head_dim divides whenever n_heads does)
            ok = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
            fix = ("pad it: vocab_multiple a multiple of tp (Megatron's --make-vocab-size-divisible-by)"
                   if what.startswith("vocab") else f"change {what.split()[0]}")
            problems.append(f"tp={t} does not divide the model's {what}={n}: choose tp from {ok} or {fix}")
    if cfg.n_kv_heads % t and t % cfg.n_kv_heads:
        problems.append(f"tp={t} and n_kv_heads={cfg.n_kv_heads}: one must divide the other "
                        f"(split the kv heads, or replicate each on tp/n_kv ranks)")
    if problems:
        raise ValueError("; ".join(problems))


def apply_tensor_parallel(model, mesh_or_group=None, sequence_parallel: bool = False):
    """Convert the shared model IN PLACE: each rank keeps its slice of every full weight. mesh_or_group: a
    Mesh (its "tp" group), a process group, or None (the world). model: a model.Transformer or a pipeline.Stage
    (whatever of embedding, layers, norm and head it has). Sets model.tp_group, model.sequence_parallel (a
    pipeline stage then sends [b, S/t, H]) and model.tp_partial_grads = {parameter name: (slot, n_slots)}."""
    group = resolve_group(mesh_or_group, "tp")
    t, cfg, sp = dist.get_world_size(group), model.cfg, sequence_parallel
    check_divisible(cfg, t)
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings.weight, group, sp)
    if sp and getattr(model, "pos_embeddings", None) is not None:
        model.pos_embeddings = SequenceParallelPositions(model.pos_embeddings.weight, group)
    for block in (model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers):
        block.attn = ParallelAttention(block.attn, cfg, group, sp)
        if isinstance(block.mlp, SwiGLU):  # a MoE stays whole: expert parallel splits its tokens instead
            block.mlp = ParallelSwiGLU(block.mlp, group, sp)
        elif isinstance(block.mlp, GeluMLP):
            block.mlp = ParallelGeluMLP(block.mlp, group, sp)
    if getattr(model, "output", None) is not None:   # the head: logits stay split by vocabulary
        r, V = dist.get_rank(group), cfg.padded_vocab
        model.output = ColumnParallelLinear(model.output.weight, group, (r * V // t, (r + 1) * V // t),
                                            input_op="gather" if sp else "copy")
        model.loss_fn = VocabParallelCrossEntropy(r * V // t, group, cfg.vocab_size if V != cfg.vocab_size else None)
        if cfg.tie_embeddings and getattr(model, "tok_embeddings", None) is not None:
            model.output.weight = model.tok_embeddings.weight   # the same rows of the same matrix: one parameter
    model.tp_group, model.sequence_parallel, model.tp_partial_grads = group, sp, {}
    for name, mod in model.named_modules():
        if isinstance(mod, ParallelAttention) and mod.kv_slot is not None:
            for w in ("wk", "wv"):
                for p, _ in getattr(mod, w).named_parameters():
                    mark_partial(model, f"{name}.{w}.{p}", *mod.kv_slot)
        elif sp:  # what each rank applied to its S/t tokens alone: the norms, row-parallel biases, positions
            partial = ("weight", "bias") if isinstance(mod, (RMSNorm, LayerNorm)) else \
                ("bias",) if isinstance(mod, RowParallelLinearWithBias) else \
                ("weight",) if isinstance(mod, SequenceParallelPositions) else ()
            for p in partial:
                if getattr(mod, p, None) is not None:
                    mark_partial(model, f"{name}.{p}")
    return model


def mark_partial(model, name: str, slot: int = 0, n_slots: int = 1) -> None:
    """Declare parameter `name`'s gradient partial over tp: finish_grads sums it over the tp group into
    slot `slot` of n_slots (a slot's ranks share it) — slot 0 of 1 is a plain sum (e.g. a router)."""
    model.tp_partial_grads[name] = (slot, n_slots)


def finish_grads(model, params=None) -> None:
    """After backward: sum over tp the gradients each rank holds only a part of, in ONE all-reduce. Each
    partial gradient goes into its slot of a zero buffer [n_slots, ...]: the sum gives each slot the total over
    the ranks sharing it. params: only those (found by name, so parameters that ZeRO replaced are found too);
    no collective if none of them is partial. Every tp rank must call it with the same parameters, in order."""
    group, partial = getattr(model, "tp_group", None), getattr(model, "tp_partial_grads", {})
    named = dict(model.named_parameters())
    wanted = None if params is None else {id(p) for p in params}
    names = [n for n in partial if wanted is None or id(named[n]) in wanted]
    if not names or group is None or dist.get_world_size(group) == 1:
        return
    bufs = [named[n].new_zeros((partial[n][1],) + named[n].shape) for n in names]
    for n, buf in zip(names, bufs):
        if named[n].grad is not None:
            buf[partial[n][0]] = named[n].grad
    all_reduce_flat(bufs, group)
    for n, buf in zip(names, bufs):
        named[n].grad = buf[partial[n][0]].clone()


def train_step(model, opt, x, y):
    """One optimizer step of a tensor-parallel model: finish_grads between backward and step."""
    loss = model(x, y)
    loss.backward()
    finish_grads(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


if __name__ == "__main__":  # the demo (float64 against one process and DTensor, bytes, timing) is in the package
    from lab.tensor_parallel_demo import main
    main()
