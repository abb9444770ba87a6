"""Lesson 6 — context parallel: ring attention (contiguous and zigzag) and Ulysses.

Context parallel (cp) cuts the sequence of every batch into cp shards, one per rank. Everything in a
transformer is token-wise except attention, which needs every key and value. Two ways to give it them:

Ring attention (Liu et al. 2023, arXiv:2310.01889): queries stay home; key/value blocks travel around a
ring of cp ranks. At step t rank r holds the block of rank (r - t) mod cp, starts passing it on, and
folds its scores against it into a running output by the online softmax (Milakov & Gimelshein 2018,
arXiv:1805.02867), in the log-sum-exp form of zhuzilin's ring-flash-attention (`_update_out_and_lse`):
    lse' = lse - logsigmoid(lse - lse_b)        out' = out - sigmoid(lse_b - lse)·(out - out_b)
exact, overflow-free, in fp32. The backward runs the ring again: k, v travel with their gradient
accumulators dk, dv, which reach their owner one hop after the last step. Under a causal mask a
contiguous split is unbalanced (rank r attends to r + 1/2 blocks' worth of keys); the zigzag layout
(the same project's zigzag ring; Llama 3's context parallel, Dubey et al. 2024, arXiv:2407.21783
§3.3.2, balances the same way) cuts S into 2·cp chunks and gives rank i chunks i and 2·cp-1-i.

Ulysses (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all turns sequence shards of all heads into
whole sequences of H/cp heads, attention runs locally, a second all-to-all turns the output back. Heads
must divide by cp (kv heads too, or they are repeated up to H). Ring x Ulysses (USP, Fang & Zhao 2024,
arXiv:2405.07719): cp = R·U; the all-to-all spans U consecutive cp ranks, the ring the other R.

Bytes one rank sends per layer (c = S/cp tokens held, d_kv = H_kv·D, b bytes per element, batch B;
a send's bytes are what goes on the wire; an all-to-all's API bytes, of which (cp-1)/cp leave):
    ring forward     (cp-1)·2·B·c·d_kv·b                      k, v passed on cp-1 times
    ring backward    (cp-1)·2·B·c·d_kv·b + cp·2·B·c·d_kv·4    k, v again + fp32 dk, dv going home
                     (float64 inputs: 8 for 4, the accumulators stay float64)
    Ulysses, each way  B·c·(H + 2·H_kv)·D·b  +  B·c·H·D·b      (q, k, v there; the output back)
Memory per rank: q, k, v, output O(S/cp) instead of O(S); the ring's scores one block at a time,
[B, H, S/cp, S/cp] (zigzag: [B, H, S/2cp, S/2cp]) instead of [B, H, S, S].
To train, each rank runs the model on its shard with the shard's absolute positions (shard_sequence,
shard_positions) and this attention in every block's `attn.sdpa`; the parameter gradients are then
averaged over the cp ranks like data parallel's (ddp.average_gradients): each rank's loss is the mean
over its S/cp tokens, so the average of the ranks' gradients is the gradient of the global mean.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

LAYOUTS, METHODS = ("contiguous", "zigzag"), ("ring", "ulysses")


# ---- layouts: which chunks of the sequence each rank holds ----------------------------------------

def chunk_ids(layout: str, cp: int, rank: int) -> list[int]:
    """The sequence chunks rank `rank` holds: contiguous cuts S into cp chunks, zigzag into 2·cp."""
    return [rank] if layout == "contiguous" else [rank, 2 * cp - 1 - rank]


def ring_schedule(cp: int, rank: int, layout: str, causal: bool = True) -> list:
    """The ring's plan on one rank, forward and backward alike: [(t, src, pairs)]. At step t the rank holds
    the k, v block of rank src = (rank - t) mod cp and computes pairs (i, j, diagonal): its query chunk i
    against the block's key chunk j. Causal: a pair wholly in the future is skipped, a diagonal one masked."""
    mine, plan = chunk_ids(layout, cp, rank), []
    for t in range(cp):
        src = (rank - t) % cp
        theirs = chunk_ids(layout, cp, src)
        plan.append((t, src, [(i, j, causal and kc == qc) for i, qc in enumerate(mine)
                              for j, kc in enumerate(theirs) if not causal or kc <= qc]))
    return plan


# ---- one block of attention, by hand, returning its log-sum-exp -----------------------------------

def _expand_kv(x, n_heads):  # GQA: kv head j serves query heads j·g .. j·g + g - 1 (as SDPA's enable_gqa)
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _scores(q, k, scale, diagonal):                     # [B, H, cq, ck]; masked above the diagonal
    s = q @ _expand_kv(k, q.shape[1]).transpose(-2, -1) * scale
    return s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf")) if diagonal else s


def block_forward(q, k, v, scale, diagonal):
    """q [B, H, cq, D], k, v [B, Hkv, ck, D] -> out [B, H, cq, D], lse [B, H, cq]."""
    s = _scores(q, k, scale, diagonal)
    lse = s.logsumexp(-1)
    return torch.exp(s - lse[..., None]) @ _expand_kv(v, q.shape[1]), lse


def block_backward(q, k, v, do, lse, delta, scale, diagonal):
    """One block's gradients, FlashAttention-style: P recomputed from each query row's FINAL lse is the
    true softmax restricted to this block, so dS = P ∘ (dP − rowsum(dO ∘ O)) needs only delta."""
    H, Hkv = q.shape[1], k.shape[1]
    p = torch.exp(_scores(q, k, scale, diagonal) - lse[..., None])          # [B, H, cq, ck]
    ds = p * (do @ _expand_kv(v, H).transpose(-2, -1) - delta[..., None])
    fold = lambda g: g.unflatten(1, (Hkv, H // Hkv)).sum(2)                 # noqa: E731  [B, Hkv, ck, D]
    return ds @ _expand_kv(k, H) * scale, fold(ds.transpose(-2, -1) @ q * scale), fold(p.transpose(-2, -1) @ do)


def merge(out, lse, block_out, block_lse):
    """Fold a block's (out_b, lse_b) into the running (out, lse): the softmax over both blocks' keys.
    lse' = log(e^lse + e^lse_b), out' = (e^lse·out + e^lse_b·out_b) / (e^lse + e^lse_b), written with
    logsigmoid and sigmoid, which never overflow (zhuzilin's ring-flash-attention)."""
    if out is None:
        return block_out, block_lse
    return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out), lse - F.logsigmoid(lse - block_lse)


def merge_textbook(out, lse, block_out, block_lse):
    """The same fold as the online softmax is usually written (Milakov & Gimelshein): subtract the
    running maximum m before exp, so exp never sees a large argument."""
    if out is None:
        return block_out, block_lse
    m = torch.maximum(lse, block_lse)
    a, b = torch.exp(lse - m), torch.exp(block_lse - m)
    return (a[..., None] * out + b[..., None] * block_out) / (a + b)[..., None], m + torch.log(a + b)


# ---- the ring ------------------------------------------------------------------------------------

class RingPass:
    """Send tensors to the next rank of the ring and receive the same shapes from the previous one,
    asynchronously (one batch, so no pair of neighbours can deadlock): start it, compute, wait()."""

    def __init__(self, tensors, group):
        n, me = dist.get_world_size(group), dist.get_rank(group)
        nxt, prv = (dist.get_global_rank(group, (me + step) % n) for step in (1, -1))
        self.sent = [t.contiguous() for t in tensors]   # alive until the sends are done
        self.bufs = [torch.empty_like(t) for t in self.sent]
        self.reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt, group) for t in self.sent]
                                           + [dist.P2POp(dist.irecv, b, prv, group) for b in self.bufs])

    def wait(self):
        for r in self.reqs:
            r.wait()
        return self.bufs


class RingAttention(torch.autograd.Function):
    """q [B, H, c, D], k, v [B, Hkv, c, D] (this rank's shard, in `layout`) -> out [B, H, c, D]."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        work_dtype, scale = torch.promote_types(q.dtype, torch.float32), q.shape[-1] ** -0.5  # fp32 at least
        n = len(chunk_ids(layout, cp, 0))
        qs, outs, lses = q.to(work_dtype).chunk(n, dim=2), [None] * n, [None] * n     # n x [B, H, c/n, D]
        kb, vb = k, v                                      # the block in hand travels in its own dtype
        for t, src, pairs in ring_schedule(cp, rank, layout, causal):
            nxt = RingPass([kb, vb], group) if t < cp - 1 else None      # the next block moves while we compute
            ks, vs = kb.to(work_dtype).chunk(n, dim=2), vb.to(work_dtype).chunk(n, dim=2)
            for i, j, diagonal in pairs:
                outs[i], lses[i] = merge(outs[i], lses[i], *block_forward(qs[i], ks[j], vs[j], scale, diagonal))
            if nxt is not None:
                kb, vb = nxt.wait()
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)     # [B, H, c, D] in work_dtype, [B, H, c]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.causal = group, layout, causal
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, rank, group = dist.get_world_size(ctx.group), dist.get_rank(ctx.group), ctx.group
        work_dtype, scale, n = out.dtype, q.shape[-1] ** -0.5, len(chunk_ids(ctx.layout, cp, 0))
        do = dout.to(work_dtype)
        delta = (do * out).sum(-1)                                      # rowsum(dO ∘ O) [B, H, c]
        qs, dos, lses, deltas = (x.chunk(n, dim=2) for x in (q.to(work_dtype), do, lse, delta))
        dq = torch.zeros_like(q, dtype=work_dtype)
        dqs, kb, vb, acc = dq.chunk(n, dim=2), k, v, None               # dqs: views, += writes into dq
        for t, src, pairs in ring_schedule(cp, rank, ctx.layout, ctx.causal):
            nxt = RingPass([kb, vb], group) if t < cp - 1 else None
            ks, vs = kb.to(work_dtype).chunk(n, dim=2), vb.to(work_dtype).chunk(n, dim=2)
            # my share of block src's gradients
            dk, dv = torch.zeros_like(kb, dtype=work_dtype), torch.zeros_like(vb, dtype=work_dtype)
            for i, j, diagonal in pairs:
                g_q, g_k, g_v = block_backward(qs[i], ks[j], vs[j], dos[i], lses[i], deltas[i], scale, diagonal)
                dqs[i].add_(g_q)
                dk.chunk(n, dim=2)[j].add_(g_k)
                dv.chunk(n, dim=2)[j].add_(g_v)
            if acc is not None:   # block src's accumulator arrived from the previous rank, who added its share
                dk, dv = (a + mine for a, mine in zip(acc.wait(), (dk, dv)))
            # ... and goes on: the next rank holds block src next step, or owns it after the last step
            acc = RingPass([dk, dv], group) if cp > 1 else None
            if nxt is not None:
                kb, vb = nxt.wait()
        dk, dv = acc.wait() if acc is not None else (dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# ---- Ulysses: all-to-all from sequence shards to head shards and back ------------------------------

class _AllToAll(torch.autograd.Function):
    """x cut into U pieces along scatter_dim, piece j to rank j; what arrives, concatenated along
    gather_dim. Its backward is the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims, U = group, (scatter_dim, gather_dim), dist.get_world_size(group)
        if U == 1:
            return x
        send = torch.stack(x.chunk(U, dim=scatter_dim)).contiguous()    # [U, ...]: row j goes to rank j
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)                  # row i came from rank i
        return torch.cat(recv.unbind(0), dim=gather_dim)

    @staticmethod
    def backward(ctx, g):
        return _AllToAll.apply(g, ctx.group, *reversed(ctx.dims)), None, None, None


def check_ulysses(n_heads: int, cp: int) -> None:
    if n_heads % cp:
        raise ValueError(f"Ulysses gives each of the cp={cp} ranks n_heads/cp heads, but n_heads={n_heads} is not "
                         f"divisible by {cp}: choose cp from {[d for d in range(1, n_heads + 1) if n_heads % d == 0]} "
                         f"or use ring attention")


def ulysses_attention(q, k, v, group, layout, causal, ring_group=None):
    """q [B, H, c, D], k, v [B, Hkv, c, D] sequence shards -> out [B, H, c, D]. With ring_group: ring
    attention over it on what the Ulysses all-to-all over `group` gathered (cp = ring size · U)."""
    U, R = dist.get_world_size(group), 1 if ring_group is None else dist.get_world_size(ring_group)
    H, me = q.shape[1], 0 if ring_group is None else dist.get_rank(ring_group)
    if k.shape[1] % U:                  # fewer kv heads than ranks (GQA): repeat them up to H
        k, v = _expand_kv(k, H), _expand_kv(v, H)
    hq, hkv = H // U, k.shape[1] // U
    # one all-to-all for q, k and v: heads grouped by destination, [B, U·(hq + 2·hkv), c, D]
    qkv = torch.cat([t.unflatten(1, (U, -1)) for t in (q, k, v)], dim=2).flatten(1, 2)
    qkv = _AllToAll.apply(qkv, group, 1, 2)                           # [B, hq + 2·hkv, U·c, D]: U shards
    held = [i for u in range(U) for i in chunk_ids(layout, U * R, me * U + u)]    # the chunk at each place
    order = sorted(range(len(held)), key=held.__getitem__)           # ascending chunks: the whole sequence
    back = sorted(range(len(held)), key=order.__getitem__)           # (R = 1), or the ring shard in `layout`
    q, k, v = qkv.unflatten(2, (len(held), -1))[:, :, order].flatten(2, 3).split([hq, hkv, hkv], dim=1)
    if ring_group is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)
    else:
        o = RingAttention.apply(q, k, v, ring_group, layout, causal)
    o = o.unflatten(2, (len(held), -1))[:, :, back].flatten(2, 3)      # [B, hq, U·c, D] in shard order
    return _AllToAll.apply(o, group, 2, 1)                            # [B, H, c, D]


def ring_ulysses_groups(cp_groups: list[list[int]], ulysses: int):
    """Split every cp group (global ranks in cp order) into U-rank Ulysses groups (consecutive cp ranks)
    and R-rank rings (the ranks at the same place of each Ulysses group), so cp rank i·U + u is ring
    rank i, Ulysses rank u. new_group is a collective over the whole world: every rank calls this with
    the same lists. Returns this rank's (ring group, Ulysses group)."""
    if any(len(ranks) % ulysses for ranks in cp_groups):
        raise ValueError(f"the Ulysses size {ulysses} must divide the cp size {len(cp_groups[0])}")
    mine = [None, None]
    for ranks in cp_groups:
        grid = torch.tensor(ranks).view(-1, ulysses)                  # [R, U]
        for k, rows in enumerate((grid.T.tolist(), grid.tolist())):  # rings: columns; Ulysses: rows
            for r in rows:
                g = dist.new_group(r)
                mine[k] = g if dist.get_rank() in r else mine[k]
    return tuple(mine)


# ---- the module that takes the place of block.attn.sdpa ---------------------------------------------

def check_layout(seq_len: int, cp: int, layout: str) -> None:
    """Raise ValueError (on every rank alike: arithmetic) unless S splits into the layout's chunks."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} unknown: choose one of {LAYOUTS}")
    n = cp if layout == "contiguous" else 2 * cp
    if seq_len % n:
        raise ValueError(f"sequence length {seq_len} is not divisible by {n} (the {layout} layout cuts it into "
                         f"{'cp' if n == cp else '2*cp'} = {n} equal chunks): use a multiple of {n}")


class ContextParallelAttention(nn.Module):
    """Attention over a sequence sharded across `group` (rotary used the shard's absolute positions): "ring"
    or "ulysses" (with ring_group: Ulysses over `group` × a ring over ring_group), "contiguous" or "zigzag"."""

    def __init__(self, group, method: str = "ring", layout: str = "zigzag", causal: bool = True, ring_group=None):
        super().__init__()
        if method not in METHODS or (ring_group is not None and method != "ulysses"):
            raise ValueError(f"method {method!r} unknown: choose one of {METHODS} (ring_group goes with 'ulysses')")
        check_layout(2, 1, layout)
        self.group, self.method, self.layout, self.causal, self.ring_group = group, method, layout, causal, ring_group
        self.cp = dist.get_world_size(group) * (1 if ring_group is None else dist.get_world_size(ring_group))

    def forward(self, q, k, v):
        check_layout(q.shape[2] * self.cp, self.cp, self.layout)   # shapes every rank shares: all raise alike
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
        if self.method == "ring":
            return RingAttention.apply(q, k, v, self.group, self.layout, self.causal)
        check_ulysses(q.shape[1], dist.get_world_size(self.group))
        return ulysses_attention(q, k, v, self.group, self.layout, self.causal, self.ring_group)


def shard_sequence(x: torch.Tensor, cp: int, rank: int, layout: str, dim: int = 1) -> torch.Tensor:
    """This rank's part of x along the sequence dimension `dim` ([B, S] -> [B, S/cp])."""
    check_layout(x.shape[dim], cp, layout)
    chunks = x.chunk(cp if layout == "contiguous" else 2 * cp, dim)
    return torch.cat([chunks[i] for i in chunk_ids(layout, cp, rank)], dim)


def shard_positions(seq_len: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """Absolute positions of the tokens this rank holds (rotary needs them, not 0..S/cp-1)."""
    return shard_sequence(torch.arange(seq_len), cp, rank, layout, dim=0)


if __name__ == "__main__":  # the demo (every method against SDPA, bytes, FLOPs, memory, waits) is in the package
    from lab.ring_attention_demo import main
    main()
