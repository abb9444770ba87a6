"""Lesson 5 — pipeline parallel: stages, micro-batches, and the schedule.

The idea
--------
Cut the model by depth into p stages, one per rank of the pp group: stage 0 holds the
embedding and the first layers, stage p-1 the last layers, the final norm, the head and
the loss. The local batch [B, S] is split into m micro-batches [B/m, S]; a stage works on
micro-batch i while its neighbours work on others. What order each stage does its
forwards (F i) and backwards (B i) in is the *schedule*, and here a schedule is plain
data: a list of actions per stage, built by a pure function and executed by one runner.

    GPipe  stage r:  F0 F1 .. F(m-1)  B0 B1 .. B(m-1)             holds m micro-batches
    1F1B   stage r:  w = min(p-r-1, m) warm-up forwards, then F B F B .., then the last w B's
                     holds at most min(p-r, m) micro-batches (needs m >= p)

Bubble: with forward time t_f and backward time t_b per micro-batch and stage, every
stage is busy m(t_f+t_b) of a step that lasts (m+p-1)(t_f+t_b), for both schedules:
    idle fraction = (p-1)/(m+p-1)          (= (p-1)/m of the ideal time)
1F1B does not shrink the bubble; it shrinks the activations held, from m micro-batches
to at most p, so m can grow (and the bubble shrink) without running out of memory.

Communication per step, per stage boundary: m activations forward and m gradients
backward, each [B/m, S, H], i.e. 2·B·S·H·b bytes — point-to-point, neighbours only.
Memory saved: a stage holds L/p of the layers (and their gradients, optimizer state) and
the activations of L/p layers for at most m (GPipe) or min(p-r, m) (1F1B) micro-batches.
Gradients: each micro-batch loss is scaled by 1/m, so the m backwards sum to the
full-batch gradient; replicas of a stage (an optional dp group) all-reduce it once, at the end.
"""
from __future__ import annotations

import argparse
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from model import Transformer, build_model, get_config, init_tensor, rope_cos_sin

COMPUTE, COMM = ("F", "B"), ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


# ---- the split ------------------------------------------------------------------------

def split_layers(n_layers: int, p: int) -> list[range]:
    """Layer indices of each stage. Balanced; if p does not divide n_layers, the first
    n_layers % p stages take one layer more (the last stage already carries the head
    and the loss, the first only an embedding lookup)."""
    base, extra = divmod(n_layers, p)
    sizes = [base + (r < extra) for r in range(p)]
    starts = [sum(sizes[:r]) for r in range(p)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def validate(p: int, m: int, n_layers: int, batch: int, schedule: str = "gpipe") -> None:
    """Pure arithmetic every rank can do alike, so a bad setting fails on every rank
    before the first send (rather than one rank raising while the others wait)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {sorted(SCHEDULES)}")
    if m < 1 or batch % m:
        raise ValueError(f"batch {batch} is not divisible into {m} micro-batches: "
                         f"choose --microbatches among {[d for d in range(1, batch + 1) if batch % d == 0]}")
    if n_layers < p:
        raise ValueError(f"{n_layers} layers cannot fill {p} pipeline stages (each needs >= 1 layer): "
                         f"use at most {n_layers} stages or a model with >= {p} layers")
    if schedule == "1f1b" and m < p:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages, got m={m} < p={p}: "
                         f"use --microbatches >= {p} (or the gpipe schedule)")


class Stage(nn.Module):
    """Stage r of p of the shared Transformer: parameters keep the full model's names
    (layers.5.attn.wq.weight), so each is initialised exactly as in the whole model."""

    def __init__(self, cfg, r: int, p: int, seed: int = 0, device=None, dtype=torch.float32):
        super().__init__()
        self.cfg, self.is_first, self.is_last = cfg, r == 0, r == p - 1
        with torch.device("meta"):                          # shapes only: no memory for other stages
            full = Transformer(cfg, seed=None)
        self.layer_ids = split_layers(cfg.n_layers, p)[r]
        self.tok_embeddings = full.tok_embeddings if self.is_first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in self.layer_ids})
        if self.is_last:
            self.norm, self.output, self.loss_fn = full.norm, full.output, full.loss_fn
        self.to_empty(device=device or "cpu")
        with torch.no_grad():
            for name, prm in self.named_parameters():       # this stage's slice, values by name
                prm.copy_(init_tensor(cfg, name, tuple(prm.shape), seed))
        self.to(dtype)
        self.positions = None  # absolute token positions [S] (a context-parallel shard); None: 0..S-1

    def forward(self, x, targets=None, positions=None):
        """x: tokens [b, S] (first stage) or activations [b, S, H] -> [b, S, H],
        or on the last stage logits [b, S, V] (targets None) or the mean loss.
        positions as in model.Transformer.forward (default: the attribute self.positions,
        so that pipeline_step, which passes only x and targets, can use them too)."""
        h = self.tok_embeddings(x) if self.is_first else x
        pos = positions if positions is not None else self.positions
        pos = pos if pos is not None else torch.arange(h.shape[1], device=h.device)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if not self.is_last:
            return h
        logits = self.output(self.norm(h))
        return logits if targets is None else self.loss_fn(logits, targets)


# ---- schedules as data -------------------------------------------------------------------

@dataclass(frozen=True)
class Action:
    op: str   # F, B (compute) or SEND_F, RECV_F, SEND_B, RECV_B (to/from a neighbour)
    mb: int   # micro-batch index

    def __repr__(self):
        return f"{self.op}{self.mb}"


def _with_comm(order, r: int, p: int) -> list[Action]:
    """Wrap a stage's compute order with its transfers: receive an input right before
    using it, send an output right after making it."""
    out = []
    for op, i in order:
        if op == "F":
            out += [Action("RECV_F", i)] * (r > 0) + [Action("F", i)] + [Action("SEND_F", i)] * (r < p - 1)
        else:
            out += [Action("RECV_B", i)] * (r < p - 1) + [Action("B", i)] + [Action("SEND_B", i)] * (r > 0)
    return out


def gpipe(p: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards: every stage holds all m micro-batches."""
    return [_with_comm([("F", i) for i in range(m)] + [("B", i) for i in range(m)], r, p) for r in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """Warm-up of w = min(p-r-1, m) forwards, then alternate F and B, then drain the w backwards.
    A stage starts a backward as soon as one can arrive, so at most w+1 micro-batches wait."""
    if m < p:
        raise ValueError(f"1F1B needs m >= p micro-batches, got m={m}, p={p}")
    sched = []
    for r in range(p):
        w = min(p - r - 1, m)
        order = [("F", i) for i in range(w)]
        for i in range(m - w):
            order += [("F", w + i), ("B", i)]
        order += [("B", i) for i in range(m - w, m)]
        sched.append(_with_comm(order, r, p))
    return sched


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}

_PARTNER = {"SEND_F": ("RECV_F", +1), "RECV_F": ("SEND_F", -1), "SEND_B": ("RECV_B", -1), "RECV_B": ("SEND_B", +1)}


def check_schedule(sched: list[list[Action]]) -> None:
    """Raise if a schedule is not executable: each stage must forward and backward every
    micro-batch once, receive before computing, compute before sending, and send
    exactly what its neighbour receives, in the same order."""
    p = len(sched)
    for r, acts in enumerate(sched):
        pos = {}
        for k, a in enumerate(acts):
            if (a.op, a.mb) in pos:
                raise ValueError(f"stage {r}: {a} appears twice")
            pos[(a.op, a.mb)] = k
        m = len([a for a in acts if a.op == "F"])
        for i in range(m):
            need = [("F", i), ("B", i)] + [("RECV_F", i), ("SEND_B", i)] * (r > 0) + [("SEND_F", i), ("RECV_B", i)] * (r < p - 1)
            missing = [n for n in need if n not in pos]
            if missing:
                raise ValueError(f"stage {r}: micro-batch {i} lacks {missing}")
            chain = [n for n in [("RECV_F", i), ("F", i), ("SEND_F", i), ("RECV_B", i), ("B", i), ("SEND_B", i)] if n in pos]
            if [pos[n] for n in chain] != sorted(pos[n] for n in chain):
                raise ValueError(f"stage {r}: micro-batch {i} out of order: {chain}")
        if r < p - 1:  # what r sends, r+1 receives, in the same order (and vice versa)
            for mine, theirs in (("SEND_F", "RECV_F"), ("RECV_B", "SEND_B")):
                a = [x.mb for x in acts if x.op == mine]
                b = [x.mb for x in sched[r + 1] if x.op == theirs]
                if a != b:
                    raise ValueError(f"stages {r},{r + 1}: {mine} order {a} != {theirs} order {b}")


def comm_batches(acts: list[Action]) -> list[list[Action]]:
    """Group a stage's actions: each compute alone, each run of consecutive transfers together
    (the runner issues such a run as one batch_isend_irecv)."""
    groups = []
    for a in acts:
        if a.op in COMM and groups and groups[-1][0].op in COMM:
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups


def simulate(sched: list[list[Action]], t_f: float = 1.0, t_b: float = 1.0) -> dict:
    """Play a schedule with compute times t_f, t_b and free, *rendezvous* transfers: a batch of
    transfers finishes only when every peer has reached the batch holding its partner.
    That is the strictest backend (a send waits for its receive), so a schedule that
    finishes here cannot deadlock on gloo or NCCL; one that does not raises."""
    check_schedule(sched)
    p = len(sched)
    groups = [comm_batches(a) for a in sched]
    idx, clock, posted = [0] * p, [0.0] * p, {}
    spans = [[] for _ in range(p)]
    inflight, peak = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while idx[r] < len(groups[r]):
                g = groups[r][idx[r]]
                if g[0].op in COMPUTE:
                    a = g[0]
                    t0, clock[r] = clock[r], clock[r] + (t_f if a.op == "F" else t_b)
                    inflight[r] += 1 if a.op == "F" else -1
                    peak[r] = max(peak[r], inflight[r])
                    spans[r].append((a, t0, clock[r]))
                else:
                    for a in g:
                        posted.setdefault((r, a), clock[r])
                    partners = [(r + _PARTNER[a.op][1], Action(_PARTNER[a.op][0], a.mb)) for a in g]
                    if not all(q in posted for q in partners):
                        break  # blocked until the peers get there
                    done = max([posted[(r, a)] for a in g] + [posted[q] for q in partners])
                    spans[r] += [(a, posted[(r, a)], done) for a in g]
                    clock[r] = done
                idx[r] += 1
                progress = True
    if any(idx[r] < len(groups[r]) for r in range(p)):
        stuck = {r: groups[r][idx[r]] for r in range(p) if idx[r] < len(groups[r])}
        raise RuntimeError(f"schedule deadlocks: stages wait at {stuck}")
    total = max(clock)
    busy = [sum(e - s for a, s, e in sp if a.op in COMPUTE) for sp in spans]
    return dict(spans=spans, total=total, bubble=[1 - b / total for b in busy], peak_in_flight=peak)


def bubble_formula(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


# ---- the runner --------------------------------------------------------------------------

@dataclass
class PipeGroup:
    """Where this stage sits: index r of p, and its neighbours' *global* ranks."""
    r: int
    p: int
    prev: int | None
    next: int | None

    @classmethod
    def from_ranks(cls, ranks: list[int]) -> "PipeGroup":
        r = ranks.index(dist.get_rank())
        return cls(r, len(ranks), ranks[r - 1] if r > 0 else None, ranks[r + 1] if r < len(ranks) - 1 else None)


class _SavedActivations:
    """Measures, not assumes, the activations held: autograd's saved tensors of each
    micro-batch (floating point, not parameters) are followed by weak references, so a
    micro-batch counts as held until autograd has really let go of its graph."""

    def __init__(self, params):
        self.param_ptrs = {q.untyped_storage().data_ptr() for q in params}
        self.refs: dict[int, list] = {}
        self.peak_mbs, self.peak_bytes = 0, 0

    def hooks(self, mb: int):
        refs = self.refs.setdefault(mb, [])

        def pack(t):
            if t.is_floating_point() and t.untyped_storage().data_ptr() not in self.param_ptrs:
                refs.append(weakref.ref(t))
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def sample(self):
        live = {mb: [t for t in (w() for w in ws) if t is not None] for mb, ws in self.refs.items()}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for ts in live.values() for t in ts}
        self.peak_mbs = max(self.peak_mbs, sum(1 for ts in live.values() if ts))
        self.peak_bytes = max(self.peak_bytes, sum(storages.values()))


def pipeline_step(stage: Stage, actions: list[Action], pg: PipeGroup, x, y, m: int,
                  dp_group=None, measure: bool = True) -> dict:
    """Run one forward+backward of the local batch x, y [B, S] (the last stage's y is its
    targets; other stages may pass None) through this stage's list of actions.
    Leaves the gradients of the full batch in stage.parameters(); returns the loss (last
    stage), the timeline of actions and the peak of micro-batches held."""
    if x.shape[0] % m or sum(a.op == "F" for a in actions) != m:
        raise ValueError(f"batch {x.shape[0]} must split into the schedule's m={m} micro-batches")
    b, S = x.shape[0] // m, x.shape[1]
    act_shape = (b, S, stage.cfg.dim)   # every transfer is [B/m, S, H]: known in advance, no shape handshake
    dtype = next(stage.parameters()).dtype
    xs = x.chunk(m) if stage.is_first else None
    ys = y.chunk(m) if stage.is_last else None
    inputs, outputs, grads_in, losses = {}, {}, {}, {}
    saved = _SavedActivations(list(stage.parameters())) if measure else None
    inflight = peak = 0
    spans, t0 = [], time.perf_counter()

    for group in comm_batches(actions):
        start = time.perf_counter() - t0
        a = group[0]
        if a.op == "F":
            inp = xs[a.mb] if stage.is_first else inputs[a.mb]
            with saved.hooks(a.mb) if measure else nullcontext():
                out = stage(inp, ys[a.mb]) if stage.is_last else stage(inp)
            if stage.is_last:
                outputs[a.mb] = out / m           # 1/m: m micro-batch means add up to the batch mean
                losses[a.mb] = out.detach()
            else:
                outputs[a.mb] = out
            inflight += 1
        elif a.op == "B":
            out = outputs.pop(a.mb)
            # out's values may already be freed (see SEND_F): backward needs only its graph.
            torch.autograd.backward(out, None if stage.is_last else grads_in.pop(a.mb))
            inflight -= 1
        else:
            # Transfers. Deadlock-freedom: a run of consecutive transfers of this stage goes
            # out as ONE batch_isend_irecv (NCCL runs its parts as a group, concurrently), and
            # schedules are built so that neighbours post matching sends and receives in the
            # same order (check_schedule). `simulate` plays every schedule with rendezvous
            # semantics (a send completes only once its receive is posted) and finds no cycle
            # of waits, so waiting for the whole batch here cannot hang.
            ops, sent = [], []
            for c in group:
                if c.op == "SEND_F":
                    ops.append(dist.P2POp(dist.isend, outputs[c.mb], pg.next))
                    sent.append(outputs[c.mb])
                elif c.op == "SEND_B":
                    inp = inputs.pop(c.mb)
                    ops.append(dist.P2POp(dist.isend, inp.grad, pg.prev))
                elif c.op == "RECV_F":
                    inputs[c.mb] = torch.empty(act_shape, dtype=dtype, device=x.device)
                    ops.append(dist.P2POp(dist.irecv, inputs[c.mb], pg.prev))
                else:  # RECV_B
                    grads_in[c.mb] = torch.empty(act_shape, dtype=dtype, device=x.device)
                    ops.append(dist.P2POp(dist.irecv, grads_in[c.mb], pg.next))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            for t in sent:
                # Sent and not needed again: free the output's memory now. Its backward needs only
                # the graph behind it (the stage ends in a residual add, which saves no output).
                t.untyped_storage().resize_(0)
            for c in group:
                if c.op == "RECV_F":
                    inputs[c.mb].requires_grad_()   # so its gradient can be sent back
        spans.append(dict(ops=[str(c) for c in group], kind=a.op if a.op in COMPUTE else "comm",
                          start=start, end=time.perf_counter() - t0))
        peak = max(peak, inflight)
        if measure:
            saved.sample()

    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        # Data-parallel replicas of this stage: one all-reduce of all gradients, after the last backward.
        params = [q for q in stage.parameters() if q.grad is not None]
        flat = torch.cat([q.grad.flatten() for q in params])
        dist.all_reduce(flat, group=dp_group)
        flat /= dist.get_world_size(dp_group)   # gloo has no ReduceOp.AVG
        for q, g in zip(params, flat.split([q.numel() for q in params])):
            q.grad.copy_(g.view_as(q))
    loss = sum(losses.values()) / m if stage.is_last else None
    return dict(loss=loss, spans=spans, peak_in_flight=peak,
                peak_held=saved.peak_mbs if measure else None,
                peak_activation_bytes=saved.peak_bytes if measure else None)


# ---- training with it, and reading the timeline -------------------------------------------

def train(cfg, schedule: str, m: int, batches, pp_ranks: list[int], dp_group=None, dp_rank: int = 0,
          dp_size: int = 1, lr: float = 1e-3, seed: int = 0, dtype=torch.float32, device="cpu",
          measure: bool = True) -> dict:
    """Train this rank's stage on global batches [(x, y)], one AdamW step each (lr=0: no
    step). Returns the losses (last stage), the first step's gradients by parameter name,
    and each step's timeline and peaks."""
    p = len(pp_ranks)
    if batches[0][0].shape[0] % dp_size:
        raise ValueError(f"global batch {batches[0][0].shape[0]} is not divisible by dp={dp_size}")
    validate(p, m, cfg.n_layers, batches[0][0].shape[0] // dp_size, schedule)  # before any send
    pg = PipeGroup.from_ranks(pp_ranks)
    actions = SCHEDULES[schedule](p, m)[pg.r]
    stage = Stage(cfg, pg.r, p, seed, device, dtype)
    opt = torch.optim.AdamW(stage.parameters(), lr=lr) if lr else None
    out = dict(stage=pg.r, losses=[], grads=None, steps=[])
    for x, y in batches:
        b = x.shape[0] // dp_size
        x, y = x[dp_rank * b:(dp_rank + 1) * b].to(device), y[dp_rank * b:(dp_rank + 1) * b].to(device)
        dist.barrier()  # all ranks start the step together: timelines share a time origin
        res = pipeline_step(stage, actions, pg, x, y, m, dp_group, measure)
        if out["grads"] is None:
            out["grads"] = {n: q.grad.detach().clone() for n, q in stage.named_parameters()}
        if opt:
            opt.step()
        stage.zero_grad(set_to_none=True)
        out["losses"].append(None if res["loss"] is None else res["loss"].item())
        out["steps"].append(res)
    out["module"] = stage
    return out


def measured_bubble(spans_per_stage: list[list[dict]]) -> tuple[list[float], float]:
    """Idle fraction of each stage over the step (start to the last stage's last action)."""
    total = max(s["end"] for spans in spans_per_stage for s in spans)
    busy = [sum(s["end"] - s["start"] for s in spans if s["kind"] in COMPUTE) for spans in spans_per_stage]
    return [1 - b / total for b in busy], total


def ascii_timeline(spans_per_stage, width: int = 72) -> str:
    """One row per stage: F forward, B backward, . idle or waiting for a transfer."""
    total = max(s["end"] for spans in spans_per_stage for s in spans)
    rows = []
    for r, spans in enumerate(spans_per_stage):
        row = ["."] * width
        for s in spans:
            if s["kind"] in COMPUTE:
                for c in range(int(s["start"] / total * width), max(int(s["end"] / total * width), int(s["start"] / total * width) + 1)):
                    row[min(c, width - 1)] = s["kind"]
        rows.append(f"  stage {r}  " + "".join(row))
    return "\n".join(rows)


def timeline_ranks(configs, model: str = "small", n_layers: int = 4, batch: int = 8, seq: int = 32,
                   steps: int = 2) -> dict:
    """For run_ranks (notebook): every rank a stage; per (schedule, m), the last step's timeline and peaks."""
    from data import get_batch, load_corpus
    tokens = load_corpus()
    batches = [get_batch(tokens, s, batch, seq) for s in range(steps)]
    out = {}
    for schedule, m in configs:
        res = train(get_config(model, n_layers=n_layers), schedule, m, batches, list(range(dist.get_world_size())), lr=0)
        last = res["steps"][-1]
        out[(schedule, m)] = dict(spans=last["spans"], peak_held=last["peak_held"],
                                  peak_activation_bytes=last["peak_activation_bytes"])
    return out


# ---- demo (PyTorch's own pipelining appears only below this line, as the reference) ------

if __name__ == "__main__":
    import copy

    from data import get_batch, load_corpus
    from instruments import time_steps
    from mesh import Mesh, init_distributed, print0
    from model import CrossEntropy

    def torch_pipelining_step(stage, pg, group, schedule, x, m, device):
        """The same split, run by torch.distributed.pipelining: returns a step function.
        Shapes are given up front, as ours are; every rank passes the loss (it tells the
        schedule there is a backward)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        b, S, cfg = x.shape[0] // m, x.shape[1], stage.cfg
        act = torch.empty(b, S, cfg.dim, device=device, requires_grad=True)  # else no gradient flows back
        ref = PipelineStage(stage, pg.r, pg.p, device, group=group,
                            input_args=(x[:b],) if stage.is_first else (act,),
                            output_args=(torch.empty(b, S, cfg.vocab_size, device=device),) if stage.is_last else (act,))
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(ref, m, loss_fn=CrossEntropy())

        def step(x, y):
            sched.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None)
        return step

    def main():
        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
        ap.add_argument("--microbatches", type=int, default=8)
        ap.add_argument("--model", default="small")
        ap.add_argument("--layers", type=int, default=None, help="override n_layers (default 2 per stage)")
        ap.add_argument("--batch", type=int, default=16)
        ap.add_argument("--seq", type=int, default=64)
        ap.add_argument("--steps", type=int, default=3)
        ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas of each stage")
        ap.add_argument("--compare", action="store_true", help="also time torch.distributed.pipelining")
        args = ap.parse_args()
        device = init_distributed()
        world = dist.get_world_size()
        if world % args.dp:
            raise ValueError(f"--dp {args.dp} must divide the world size {world}")
        mesh = Mesh(pp=world // args.dp, dp_replicate=args.dp)
        p, m = mesh.size("pp"), args.microbatches
        cfg = get_config(args.model, n_layers=args.layers or 2 * p)
        tokens = load_corpus()
        batches = [get_batch(tokens, s, args.batch, args.seq) for s in range(args.steps)]
        out = train(cfg, args.schedule, m, batches, mesh.ranks("pp"), mesh.group("dp"), mesh.rank("dp"),
                    args.dp, device=device)
        stage, last = out["module"], out["steps"][-1]
        print0(f"{args.schedule}: p={p} stages x dp={args.dp}, m={m} micro-batches of {args.batch // args.dp // m}"
               f", model {args.model} with {cfg.n_layers} layers split {[len(s) for s in split_layers(cfg.n_layers, p)]}")

        # The loss against the same model trained in one process (on the last stage's rank).
        ok = torch.ones(1)
        if out["losses"][0] is not None and mesh.rank("dp") == 0:
            ref = build_model(cfg, seed=0)
            opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
            for (x, y), got in zip(batches, out["losses"]):
                loss = ref(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                print(f"  loss {got:.6f}   single process {loss.item():.6f}   |diff| {abs(got - loss.item()):.1e}"
                      + ("   (replica 0)" if args.dp > 1 else ""), flush=True)
                ok[0] *= abs(got - loss.item()) < 1e-4
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)

        # The timeline of the last step: measured bubble and activations held, against theory.
        gathered = [None] * world
        dist.all_gather_object(gathered, (mesh.coords["pp"], mesh.rank("dp"), last))
        stages = sorted((g for g in gathered if g[1] == 0), key=lambda g: g[0])
        spans = [g[2]["spans"] for g in stages]
        bubble, total = measured_bubble(spans)
        sim = simulate(SCHEDULES[args.schedule](p, m))
        print0(f"last step {total * 1e3:.0f} ms; timeline (F forward, B backward, . idle):\n" + ascii_timeline(spans))
        print0(f"  bubble: formula (p-1)/(m+p-1) = {bubble_formula(p, m):.3f}; measured per stage "
               + " ".join(f"{b:.3f}" for b in bubble) + f" (mean {sum(bubble) / p:.3f})")
        print0("  micro-batches held at peak per stage (schedule / measured from autograd's saved tensors): "
               + "  ".join(f"{s}/{g[2]['peak_held']}" for s, g in zip(sim["peak_in_flight"], stages))
               + "   activation MB at peak: " + " ".join(f"{g[2]['peak_activation_bytes'] / 2**20:.1f}" for g in stages))

        if args.compare and args.dp == 1:
            pg = PipeGroup.from_ranks(mesh.ranks("pp"))
            x, y = (t.to(device) for t in batches[0])
            ours, theirs = copy.deepcopy(stage), copy.deepcopy(stage)
            actions = SCHEDULES[args.schedule](p, m)[pg.r]

            def ours_step():
                pipeline_step(ours, actions, pg, x, y, m, measure=False)
            theirs_step = torch_pipelining_step(theirs, pg, mesh.group("pp"), args.schedule, x, m, device)
            theirs_step(x, y)  # one step each, then their gradients must equal ours
            ours_step()
            diff = torch.tensor([max((a.grad - b.grad).abs().max().item() if b.grad is not None else float("inf")
                                     for a, b in zip(ours.parameters(), theirs.parameters()))])
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            t_ours, t_theirs = [], []
            for _ in range(3):  # alternate, so drift in machine load hits both alike
                for mod in (ours, theirs):
                    mod.zero_grad(set_to_none=True)
                dist.barrier()
                t_ours.append(time_steps(ours_step, 2, device=device))
                dist.barrier()
                t_theirs.append(time_steps(lambda: theirs_step(x, y), 2, device=device))
            t = torch.tensor([min(t_ours), min(t_theirs)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            print0(f"  torch.distributed.pipelining: gradients max |diff| {diff.item():.1e}; step time ours "
                   f"{t[0] * 1e3:.1f} ms, theirs {t[1] * 1e3:.1f} ms -> our throughput {t[1] / t[0]:.2f}x theirs")
        print0("loss matches the single-process model:", "ok" if ok.item() == 1 else "FAILED")
        dist.destroy_process_group()
        if ok.item() != 1:
            raise SystemExit(1)

    main()
