"""Lesson 5 — pipeline parallel: stages, micro-batches and the runner.

Cut the model by depth into p stages, one per rank of the pp group: stage 0 holds the embedding and
the first layers, stage p-1 the last layers, the final norm, the head and the loss. The local batch
[B, S] is split into m micro-batches [B/m, S]; a stage works on one micro-batch while its neighbours
work on others. The order of its forwards (F), backwards (B) and weight-gradient passes (W) is the
*schedule*: pipeline_schedules.py builds GPipe, 1F1B, interleaved 1F1B and ZB-H1 as data, checks and
plays them without a process, and states with sources each one's bubble and the micro-batches each rank
holds (1F1B: idle (p-1)(t_f+t_b+t_w) per step, (p-1)/m of the ideal m(t_f+t_b+t_w); Narayanan et al.
2021, arXiv:2104.04473 §2.2). This file runs them: 1F1B written out as plain control flow first, then
Stage (one rank's layers) and pipeline_step, one runner for any schedule. Zero bubble (Qi et al. 2024,
arXiv:2401.10241 §2) splits each backward into B, the input gradient dL/dx, and W, the weight gradient
dL/dW = dL/dy^T x: here for real, in autograd.

Communication, point to point between neighbours only: per step and stage boundary m activations
forward and m gradients back, each [B/m, S, H] — 2·B·S·H·b bytes per boundary (API bytes = wire
bytes: a send moves its tensor once); interleaved crosses p·v-1 boundaries instead of p-1.
Memory: a rank holds L/p of the layers (their gradients and optimizer state) and the activations of
the micro-batches in flight. Each micro-batch loss is scaled by 1/m, so the m backwards add up to the
full-batch gradient; data-parallel replicas of a stage all-reduce it once. With ZeRO-2/3
(fsdp.shard_model), zero bubble's W delivers weight gradients after a unit's backward has reached its
inputs, so the step must run inside opt.accumulating() (fsdp raises a clear error otherwise).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from instruments import SavedActivations, Timeline
from mesh import all_reduce_flat
from data import get_batch, load_corpus
from model import MoE, Transformer, build_model, get_config, init_tensor, rope_cos_sin
from pipeline_schedules import (COMPUTE, SCHEDULES, Action, comm_batches, held_formula, idle_formula, simulate,
                                 split_layers, validate)


# ---- the simplest version: 1F1B as plain control flow ----------------------------------------

def one_f_one_b_plain(stage, pg, x, y, m: int):
    """One 1F1B step of this rank's stage, written out; returns the mean loss on the last stage.
    Warm-up: w = min(p-r-1, m) forwards; steady: a forward, then a backward; cool-down: w backwards."""
    shape, dtype = (x.shape[0] // m, x.shape[1], stage.cfg.dim), next(stage.parameters()).dtype
    xs, ys = x.chunk(m), y.chunk(m) if stage.is_last else None
    inputs, outputs, losses = [], [], []

    def p2p(send=None, to=None, recv_from=None):
        # A send and a receive are posted TOGETHER, then both awaited: one after the other, rank r
        # sending F i+1 while rank r+1 sends back B i would each wait for the other forever.
        buf = None if recv_from is None else torch.empty(shape, dtype=dtype, device=x.device)
        ops = ([dist.P2POp(dist.isend, send, to)] if send is not None and to is not None else []) \
            + ([dist.P2POp(dist.irecv, buf, recv_from)] if buf is not None else [])
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return buf if buf is None else buf.requires_grad_(recv_from == pg.prev)   # an input: send its gradient back

    def forward(i, inp):               # inp: tokens [b, S] or an activation [b, S, H]
        out = stage(inp, ys[i]) if stage.is_last else stage(inp)
        inputs.append(inp)
        outputs.append(out / m if stage.is_last else out)   # 1/m: m micro-batch means add up to the batch mean
        losses.extend([out.detach()] if stage.is_last else [])
        return None if stage.is_last else out.detach()

    def backward(grad):                # the oldest micro-batch in flight
        inp, out = inputs.pop(0), outputs.pop(0)
        out.backward(grad)
        return None if stage.is_first else inp.grad

    w = min(pg.p - pg.r - 1, m)
    inp = xs[0] if stage.is_first else p2p(recv_from=pg.prev)
    for i in range(w):                                            # warm-up
        p2p(forward(i, inp), pg.next)
        if i + 1 < m:
            inp = xs[i + 1] if stage.is_first else p2p(recv_from=pg.prev)
    for i in range(w, m):                                         # steady: F i, then B i-w
        grad = p2p(forward(i, inp), pg.next, pg.next)             # send F i's output, get B i-w's gradient
        more = i + 1 < m
        inp = p2p(backward(grad), pg.prev, pg.prev if more else None)   # send B i-w's, get F i+1's input
        inp = xs[i + 1] if stage.is_first and more else inp
    for _ in range(w):                                            # cool-down
        p2p(backward(p2p(recv_from=pg.next)), pg.prev)
    return torch.stack(losses).mean() if stage.is_last else None


# ---- the model part one rank holds -----------------------------------------------------------------

class Stage(nn.Module):
    """Rank r's part of the shared Transformer: its v chunks, the virtual stages r, r+p, .., r+(v-1)p of
    p·v (v = 1: stage r of p). Parameters keep the full model's names (layers.5.attn.wq.weight), so
    each is initialised as in the whole model; other ranks' layers are never allocated."""

    def __init__(self, cfg, r: int, p: int, seed: int = 0, device=None, dtype=torch.float32, v: int = 1):
        super().__init__()
        self.cfg, self.v, self.is_first, self.is_last = cfg, v, r == 0, r == p - 1
        self.chunks = [list(split_layers(cfg.n_layers, p * v)[c * p + r]) for c in range(v)]  # layer ids
        with torch.device("meta"):                                                          # shapes only
            full = Transformer(cfg, seed=None)
        self.tok_embeddings = full.tok_embeddings if self.is_first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for ids in self.chunks for i in ids})
        if self.is_last:
            self.norm, self.output, self.loss_fn = full.norm, full.output, full.loss_fn
        self.to_empty(device=device or "cpu")
        with torch.no_grad():
            for name, prm in self.named_parameters():
                prm.copy_(init_tensor(cfg, name, tuple(prm.shape), seed))
        self.to(dtype)
        self.positions = None  # absolute token positions [S] (a context-parallel shard); None: 0..S-1

    def forward(self, x, targets=None, positions=None, chunk: int = 0):
        """tokens [b, S] (chunk 0 of rank 0) or activations [b, S, H] -> [b, S, H]; the last chunk of
        the last rank returns logits [b, S, V], or the mean loss if targets are given."""
        h = self.tok_embeddings(x) if self.is_first and chunk == 0 else x
        pos = positions if positions is not None else self.positions
        pos = pos if pos is not None else torch.arange(h.shape[1], device=h.device)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        for i in self.chunks[chunk]:
            h = self.layers[str(i)](h, cos, sin)
        if not (self.is_last and chunk == self.v - 1):
            return h
        logits = self.output(self.norm(h))
        return logits if targets is None else self.loss_fn(logits, targets)

    def aux_loss(self, chunk: int = 0):
        """The MoE auxiliary loss of this chunk's last forward (as model.Transformer.aux_loss), or None."""
        aux = [self.layers[str(i)].mlp.aux_loss for i in self.chunks[chunk] if isinstance(self.layers[str(i)].mlp, MoE)]
        return sum(aux) if aux else None


# ---- the runner: any schedule, one step ----------------------------------------------------------

@dataclass
class PipeGroup:
    """Where this rank sits: index r of the p global ranks `ranks`, in pipeline order."""
    r: int
    p: int
    ranks: list

    @classmethod
    def from_ranks(cls, ranks: list[int]) -> "PipeGroup":
        return cls(list(ranks).index(dist.get_rank()), len(ranks), list(ranks))

    def peer(self, d: int) -> int:   # wraps: an interleaved last rank feeds the first rank's next chunk
        return self.ranks[(self.r + d) % self.p]

    prev = property(lambda self: self.peer(-1) if self.r > 0 else None)
    next = property(lambda self: self.peer(+1) if self.r < self.p - 1 else None)


def pipeline_step(stage: Stage, actions: list[Action], pg: PipeGroup, x, y, m: int, dp_group=None, *,
                  trace=lambda group: nullcontext()) -> dict:
    """One forward+backward of the local batch x, y [B, S] (y: the last rank's targets) through this
    rank's actions; leaves the full-batch gradients in .grad (no optimizer step, no zero_grad).
    A stage boundary carries one micro-batch's [B/m, S, H] ([B/m, S/tp, H] once tensor_parallel made the
    stage sequence parallel). trace(group): a context manager entered around each group of actions (a
    compute alone, consecutive transfers together): the place to measure from, outside.
    Returns dict(loss: the mean loss on the last rank, else None; aux: the MoE aux loss of this rank's
    layers, averaged over micro-batches — add it to the reported loss — or None)."""
    sp = getattr(stage, "sequence_parallel", False)
    shape = (x.shape[0] // m, x.shape[1] // (dist.get_world_size(stage.tp_group) if sp else 1), stage.cfg.dim)
    dtype = next(stage.parameters()).dtype
    xs, ys = x.chunk(m), (y.chunk(m) if stage.is_last else None)
    split = any(a.op == "W" for a in actions)
    inputs, outputs, grads, deferred, losses, aux = {}, {}, {}, {}, [], []

    def forward(a, key, first, last):
        out = stage(xs[a.mb] if first else inputs[key], ys[a.mb] if last else None, chunk=a.chunk)
        extra = stage.aux_loss(a.chunk)   # MoE layers: their aux loss is part of this micro-batch's loss
        outputs[key] = [out / m if last else out] + ([extra / m] if extra is not None else [])
        losses.extend([out.detach()] if last else [])
        aux.extend([extra.detach()] if extra is not None else [])

    def backward(key, last):   # (a sent activation's values are freed, see transfer: its graph is enough)
        outs = outputs.pop(key)
        grad_outs = [None if last else grads.pop(key)] + [None] * (len(outs) - 1)
        if not split:
            return torch.autograd.backward(outs, grad_outs)
        # B of a split backward: dL/d(input) now; every parameter's gradient waits for W (the linears'
        # are not even computed yet; norms', the embedding's are), so hooks see one pass per micro-batch
        params, inp = [q for q in stage.parameters() if q.requires_grad], inputs.get(key)
        got = torch.autograd.grad(outs, params + ([inp] if inp is not None else []), grad_outs, allow_unused=True)
        deferred[key] += [(q, g) for q, g in zip(params, got) if g is not None]
        if inp is not None:
            inp.grad = got[-1]

    def transfer(group):       # consecutive transfers: ONE batch_isend_irecv (NCCL runs it as a group)
        ops, sent = [], []
        for t in group:
            k, peer = (t.mb, t.chunk), pg.peer(+1 if t.op in ("SEND_F", "RECV_B") else -1)
            if t.op.startswith("SEND"):   # (contiguous: a sequence-parallel [b, S/t, H] is a transposed view)
                data = outputs[k][0] if t.op == "SEND_F" else inputs.pop(k).grad
                sent += [data] if t.op == "SEND_F" else []
                ops.append(dist.P2POp(dist.isend, data.contiguous(), peer))
            else:
                buf = (inputs if t.op == "RECV_F" else grads)[k] = torch.empty(shape, dtype=dtype, device=x.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for t in sent:   # sent, not needed again: the stage ends in a residual add, which saves no
            t.untyped_storage().resize_(0)   # output, so its backward needs only the graph
        for t in (t for t in group if t.op == "RECV_F"):
            inputs[(t.mb, t.chunk)].requires_grad_()   # so its gradient can be sent back

    for group in comm_batches(actions):
        a, key = group[0], (group[0].mb, group[0].chunk)
        first, last = stage.is_first and a.chunk == 0, stage.is_last and a.chunk == stage.v - 1
        split_here = DeferWeightGrads(deferred.setdefault(key, [])) if split and a.op in ("F", "B") else nullcontext()
        with trace(group), split_here:
            if a.op == "F":
                forward(a, key, first, last)
            elif a.op == "B":
                backward(key, last)
            elif a.op == "W":
                weight_grads(deferred.pop(key))
            else:
                transfer(group)
    if dp_group is not None and (n := dist.get_world_size(dp_group)) > 1:   # replicas of this stage: one all-reduce
        all_reduce_flat([q.grad for q in stage.parameters() if q.grad is not None], dp_group, divide_by=n)
    return dict(loss=torch.stack(losses).sum() / m if losses else None, aux=torch.stack(aux).sum() / m if aux else None)


# ---- zero bubble: B and W apart, in autograd -------------------------------------------------------

class _InputGradOnly(torch.autograd.Function):
    """y = x W^T + b whose backward returns dL/dx only (B) and leaves (x, dL/dy) for W. Weight and
    bias come in a tuple, out of autograd's sight: B has no edge to them, so no hook of theirs fires."""

    @staticmethod
    def forward(ctx, x, params, deferred):
        ctx.save_for_backward(x)
        ctx.params, ctx.deferred = params, deferred
        return F.linear(x, *params)

    @staticmethod
    def backward(ctx, gy):
        ctx.deferred.append((ctx.saved_tensors[0], gy, *ctx.params))
        return gy @ ctx.params[0], None, None


class DeferWeightGrads(TorchFunctionMode):
    """Inside it, every F.linear of a trainable weight on a differentiable input (nn.Linear, tensor_parallel's
    Column/RowParallelLinear) computes only dL/dx in backward; weight_grads(deferred) does the rest."""

    def __init__(self, deferred: list):
        super().__init__()
        self.deferred = deferred

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear or not (torch.is_grad_enabled() and args[0].requires_grad and args[1].requires_grad):
            return func(*args, **kwargs)
        x, w, b = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
        dev = x.device.type
        if torch.is_autocast_enabled(dev):   # cast as autocast would, outside the Function
            x, w, b = (t if t is None else t.to(torch.get_autocast_dtype(dev)) for t in (x, w, b))
        with torch.autocast(dev, enabled=False):
            return _InputGradOnly.apply(x, (w, b), self.deferred)


def weight_grads(deferred: list) -> None:
    """W: dL/dW = dL/dy^T x (and dL/db = sum of dL/dy) of each deferred linear — plus any (parameter,
    gradient) B already had — handed to autograd at once, so .grad and post-accumulate-grad hooks
    (ZeRO, DDP) see one ordinary backward per micro-batch."""
    pairs = [item for item in deferred if len(item) == 2]   # (parameter, gradient) computed in B: norms, embedding
    for x, gy, w, b in (item for item in deferred if len(item) == 4):
        gy2 = gy.reshape(-1, gy.shape[-1])   # [tokens, out]
        pairs += [(w, gy2.T @ x.reshape(-1, x.shape[-1]))] + ([(b, gy2.sum(0))] if b is not None else [])
    deferred.clear()
    if pairs:
        torch.autograd.backward(*zip(*pairs))


# ---- measuring from outside: the trace hook, and training with it --------------------------------

class StepTrace:
    """A `trace` for pipeline_step: one Timeline span per group of actions, and the micro-batches whose
    saved activations are alive after each group (instruments.SavedActivations)."""

    def __init__(self, stage):
        self.timeline, self.saved = Timeline(), SavedActivations(stage.parameters())

    @contextmanager
    def __call__(self, group):
        a = group[0]
        track = self.saved.track((a.mb, a.chunk)) if a.op == "F" else nullcontext()
        with self.timeline.span(a.op if a.op in COMPUTE else "comm", ops=[repr(g) for g in group]), track:
            yield
        self.saved.sample()


def train(cfg, schedule: str, m: int, batches, pp_ranks, v: int = 1, dp_group=None, dp_rank: int = 0,
          dp_size: int = 1, lr: float = 1e-3, seed: int = 0, dtype=torch.float32, device="cpu") -> dict:
    """Train this rank's stage on global batches [(x, y)], one AdamW step each (lr=0: none). Returns the
    losses (last rank), the first step's gradients by name, the last step's timeline and peak held."""
    from demo import snapshot
    validate(len(pp_ranks), m, cfg.n_layers, batches[0][0].shape[0] // dp_size, schedule, v)  # before any send
    pg = PipeGroup.from_ranks(pp_ranks)
    stage, actions = Stage(cfg, pg.r, pg.p, seed, device, dtype, v), SCHEDULES[schedule](pg.p, m, v)[pg.r]
    opt = torch.optim.AdamW(stage.parameters(), lr=lr) if lr else None
    out = dict(losses=[], grads=None, stage=stage, actions=actions, pg=pg)
    for x, y in batches:
        x, y = (t.chunk(dp_size)[dp_rank].to(device) for t in (x, y))   # this replica's share [B/dp, S]
        dist.barrier()   # every rank starts the step together: the timelines share an origin
        trace = StepTrace(stage)
        res = pipeline_step(stage, actions, pg, x, y, m, dp_group, trace=trace)
        out["grads"] = out["grads"] or snapshot(stage, grads=True)
        if opt:
            opt.step()
        stage.zero_grad(set_to_none=True)
        out["losses"].append(None if res["loss"] is None else res["loss"].item())
        out.update(spans=trace.timeline.spans, peak_held=trace.saved.peak_keys, peak_bytes=trace.saved.peak_bytes)
    return out


def timeline_ranks(configs, model: str = "small", n_layers: int = 8, batch: int = 8, seq: int = 32) -> dict:
    """For launch.run_ranks (the notebook): per (schedule, m, v), two steps with lr=0; the second's spans."""
    batches = [get_batch(load_corpus(), s, batch, seq) for s in range(2)]
    return {c: {k: v for k, v in train(get_config(model, n_layers=n_layers), c[0], c[1], batches,
                                       list(range(dist.get_world_size())), c[2], lr=0).items()
                if k in ("spans", "peak_held", "peak_bytes")} for c in configs}


# ---- demo: torchrun --nproc_per_node 4 pipeline.py --schedule 1f1b [--compare] ----------------------

def _demo(argv=None, reference=None) -> int:
    import argparse
    import os

    from demo import all_agree, finish, single_process
    from instruments import ascii_timeline, idle_share
    from mesh import Mesh, init_distributed, print0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    ap.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank (default: 2 interleaved, else 1)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--layers", type=int, default=None, help="n_layers (default: 2 per chunk)")
    for name, default in [("microbatches", 8), ("batch", 8), ("seq", 32), ("steps", 2), ("dp", 1)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--compare", action="store_true", help="also run PyTorch's own schedule of the same name")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    v = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    if world % args.dp or args.batch % args.dp:
        raise ValueError(f"--dp {args.dp} must divide the world size {world} and --batch {args.batch}")
    p, m, name = world // args.dp, args.microbatches, args.schedule
    cfg = get_config(args.model, n_layers=args.layers or 2 * p * v)
    validate(p, m, cfg.n_layers, args.batch // args.dp, name, v)   # before any collective
    device = init_distributed()
    mesh = Mesh(pp=p, dp_replicate=args.dp)
    batches = [get_batch(load_corpus(), s, args.batch, args.seq) for s in range(args.steps)]
    out = train(cfg, name, m, batches, mesh.ranks("pp"), v, mesh.group("dp"), mesh.rank("dp"), args.dp, device=device)
    every = [None] * dist.get_world_size()   # rank 0 prints what every rank of replica 0 measured
    dist.all_gather_object(every, (mesh.coords["pp"], mesh.rank("dp"), out["spans"], out["peak_held"],
                                   out["peak_bytes"], out["losses"]))
    rows = sorted((e for e in every if e[1] == 0), key=lambda e: e[0])
    ok, diff = True, 0.0
    if dist.get_rank() == 0:
        ref = single_process(build_model(cfg, seed=0), batches)["losses"]   # the same model in one process
        diff = max(abs(a - b) for a, b in zip(rows[-1][5], ref))
        ok = diff < 1e-4
        measured, total = idle_share([e[2] for e in rows])
        idle, sim = idle_formula(name, p, m, v), simulate(SCHEDULES[name](p, m, v))
        print(f"{name}: p={p} ranks x v={v} chunks x dp={args.dp}, m={m} micro-batches of {args.batch // args.dp // m};"
              f" {cfg.n_layers} layers split {[len(s) for s in split_layers(cfg.n_layers, p * v)]}\n"
              f"last step {total * 1e3:.0f} ms (F forward, B backward, W weight gradient, . idle):\n"
              + ascii_timeline([e[2] for e in rows]) + "\n"
              f"  bubble, idle share of the step: formula {idle / (3 * m + idle):.3f}, "
              f"simulated {sim['bubble'][0]:.3f}, measured per rank " + " ".join(f"{b:.3f}" for b in measured) + "\n"
              "  micro-batches held at the peak, formula/measured from autograd's saved tensors: "
              + "  ".join(f"{held_formula(name, p, m, r, v)}/{e[3]}" for r, e in enumerate(rows))
              + "   activation MB: " + " ".join(f"{e[4] / 2**20:.1f}" for e in rows), flush=True)
    ok = all_agree(ok)
    if args.compare and reference is not None and args.dp == 1:  # PyTorch's schedule, side by side
        ok &= reference(out, cfg, name, m, batches[0], device, mesh.group("pp"))
    print0(f"loss matches the single-process model: {'ok' if ok else 'FAILED'} (max |diff| {diff:.1e})")
    return finish(ok)


if __name__ == "__main__":  # PyTorch's own version only here, handed to the demo as what it compares with
    from demo import main
    from references import torch_pipelining
    main(lambda argv: _demo(argv, reference=torch_pipelining))
