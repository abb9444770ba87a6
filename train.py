"""Capstone — every strategy composed by mesh sizes, with the same loss curve on every layout.

    torchrun --nproc_per_node N train.py --dp-replicate A --dp-shard B --cp C --tp D --pp E --ep F

The mesh is [pp, dp_replicate, dp_shard, cp, tp] (mesh.py); A*B*C*D*E must equal N. Expert
parallel borrows ep of the A*B data-parallel ranks. For a fixed seed and global batch every
layout computes the same loss as one process: the global batch of step s is drawn from
(seed, s) and each data-parallel rank takes its slice; context-parallel ranks take their
slice of each sequence; the loss is the mean over all tokens of the global batch, so

    gradient = 1/(dp·cp) · Σ over dp×cp ranks of ∇(local mean loss)      (what ZeRO divides by)

Order in which the lessons are applied (each one sees the model the previous one left):
  1. pipeline split   — cuts whole layers, so it must see the unmodified model;
  2. tensor parallel  — slices the weights of the layers this stage kept;
  3. context parallel — swaps each attention's core op for ring attention (any head count);
  4. expert parallel  — swaps each MoE for its all-to-all version;
  5. activation checkpointing — wraps the (now parallel) blocks, inside the ZeRO hooks;
  6. data parallel / ZeRO / HSDP — last, because it flattens, shards and reduces exactly the
     parameters the steps above left on this rank (shard group dp_shard×cp, replicas dp_replicate).
Gradient clipping uses the norm of the WHOLE model's gradient: every rank adds the squares
of the gradient elements it holds, each weighted by 1/(number of ranks holding a copy), and
one all-reduce over the world sums them — so each parameter counts once.

Communication per step, per rank, is the sum of the lessons' (API bytes; b bytes per element,
Ψ' = Ψ/(tp·pp) the parameters of my tp slice of my stage, B' = B/dp the local batch, m micro-batches):
    ZeRO-3 (shard group dp_shard·cp)  all-gather b·(2Ψ' − Ψ'_root), reduce-scatter 4Ψ' (fp32 grads);
        in a pipeline every module is a unit: all-gather 2m·b·Ψ', reduce-scatter m·4Ψ'
    ZeRO-1/2  reduce-scatter 4Ψ' (ZeRO-2 in a pipeline: m times) + all-gather b·Ψ';  ZeRO-0  all-reduce 4Ψ'
    HSDP      + all-reduce 4Ψ'/(dp_shard·cp) over dp_replicate
    tp        4L all-reduces of [B', S/cp, H] (L: my stage's layers), +1 for the embedding, +1 for
              the head's input and +3 of [B'·S/cp] for the vocab-parallel loss (on their stages)
    pp        B'·S/cp·H·b sent and received per stage boundary, each way
    cp (ring) per layer (cp−1)·2·c·d_kv·b forward, again + dk, dv home in backward (c = S/cp)
    clipping  one all-reduce of one float64 over the world
Model state per rank (ZeRO-3, mixed precision K = 12): (b_p + b_g + K)·Ψ'/(dp_shard·cp), plus the
norm weights every tp rank keeps whole; experts: E/ep of them per rank.

    --check    rank 0 retrains the model in one process and compares the losses
    --compare  the same layout under PyTorch's FSDP2 + DTensor TP, side by side
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from data import get_batch, load_corpus
from model import CONFIGS, build_model, flops_per_token, get_config, init_tensor, num_params

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 (THEORY.md)
CP_METHOD, CP_LAYOUT = "ring", "zigzag"
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")          # mesh.py's order


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    arg = p.add_argument
    for dim in ("dp-replicate", "dp-shard", "cp", "tp", "pp", "ep"):
        arg(f"--{dim}", type=int, default=1)
    arg("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
        help="how the data-parallel dims shard (default: 3 when dp-shard > 1 and the model is dense, else 0)")
    arg("--sequence-parallel", action="store_true",
        help="with --tp: norms and residuals on S/tp tokens (all-gather/reduce-scatter for all-reduce)")
    arg("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    arg("--microbatches", type=int, default=None,
        help="micro-batches per step (default: pp; without pp they accumulate gradients)")
    arg("--model", choices=sorted(CONFIGS), default="tiny")
    arg("--experts", type=int, default=0, help="0: dense MLP")
    arg("--top-k", type=int, default=2)
    arg("--global-batch-size", type=int, default=8, help="sequences per optimizer step")
    for name, default in [("seq-len", 32), ("steps", 10), ("warmup", 2), ("seed", 0)]:
        arg(f"--{name}", type=int, default=default)
    arg("--lr", type=float, default=1e-3)
    arg("--dtype", choices=sorted(DTYPES), default="float32",
        help="bfloat16: bf16 compute, fp32 master weights, optimizer and gradient reduction")
    arg("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    arg("--data", default=None, help="a text file (default: the built-in corpus)")
    arg("--activation-checkpointing", choices=["none", "full"], default="none")
    arg("--log-file", default=None, help="append one JSON object per step")
    arg("--save", default=None, help="directory to write a checkpoint to at the end")
    arg("--stop-at", type=int, default=None,
        help="stop after this step (the schedule still runs to --steps): an interrupted run")
    arg("--resume", default=None, help="directory of a checkpoint to continue from")
    arg("--check", action="store_true",
        help="afterwards, train the same model in ONE process on rank 0 and compare the losses")
    arg("--compare", action="store_true",
        help="afterwards, run the same layout with PyTorch's FSDP2 + DTensor TP and compare")
    arg("--quiet", action="store_true", help="no per-step lines")
    args = p.parse_args(argv)
    if args.zero_stage is None:
        args.zero_stage = 3 if args.dp_shard > 1 and not args.experts else 0
    if args.microbatches is None:
        args.microbatches = args.pp
    return args


def config_of(args):
    return get_config(args.model, n_experts=args.experts, top_k=args.top_k)


def layout_of(args) -> dict:
    """What a checkpoint must agree on to be resumed."""
    return {k: getattr(args, k) for k in DIMS + ("ep", "zero_stage", "model", "experts", "top_k", "dtype",
                                                  "sequence_parallel")}


def _divisors(n: int, limit: int = 10**9) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def check_args(args, world_size: int) -> None:
    """Every invalid combination, found from the arguments alone (so every rank finds the same
    problems before any collective). Raises ValueError listing what is wrong and what is valid."""
    dims, problems, unsupported = {d: getattr(args, d) for d in DIMS}, [], []
    counts = dict(dims, ep=args.ep, microbatches=args.microbatches, global_batch_size=args.global_batch_size,
                  seq_len=args.seq_len, steps=args.steps)
    small = {k: v for k, v in counts.items() if v < 1}
    if small:
        raise ValueError("invalid training layout:\n  - " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                   small.items()) + " must be >= 1")
    product = math.prod(dims.values())
    if product != world_size:
        problems.append(f"pp*dp_replicate*dp_shard*cp*tp = {product} but the world size is {world_size}: "
                        f"choose sizes whose product is {world_size} "
                        f"(or launch with torchrun --nproc_per_node {product})")
    try:
        cfg = config_of(args)
    except ValueError as e:
        raise ValueError(f"invalid training layout:\n  - {e}") from None
    tp, cp, pp, dp, m = args.tp, args.cp, args.pp, args.dp_replicate * args.dp_shard, args.microbatches
    for name, size in [("n_heads", cfg.n_heads), ("ffn_dim", cfg.ffn_dim), ("vocab_size", cfg.vocab_size)]:
        if size % tp:
            problems.append(f"--tp {tp} does not divide the model's {name} ({size}): "
                            f"choose tp from {_divisors(size, 16)}")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        problems.append(f"--tp {tp} and n_kv_heads {cfg.n_kv_heads}: one must divide the other")
    if cfg.n_layers < pp:
        problems.append(f"--pp {pp} is more stages than the model's {cfg.n_layers} layers: "
                        f"use --pp <= {cfg.n_layers}")
    if pp > 1 and args.schedule == "1f1b" and m < pp:
        problems.append(f"1F1B needs at least as many micro-batches as stages: "
                        f"--microbatches {m} < --pp {pp} (use >= {pp}, or --schedule gpipe)")
    if args.global_batch_size % (dp * m):
        problems.append(f"--global-batch-size {args.global_batch_size} is not divisible by the data-parallel "
                        f"size {dp} times --microbatches {m}: use a multiple of {dp * m}")
    if cp > 1 and args.seq_len % (2 * cp):
        problems.append(f"--seq-len {args.seq_len} is not divisible by 2*cp = {2 * cp} "
                        f"({CP_LAYOUT} layout): use a multiple of {2 * cp}")
    if args.seq_len > cfg.max_seq_len:
        problems.append(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    if args.ep > 1:
        if not args.experts:
            problems.append("--ep > 1 needs a mixture-of-experts model: give --experts E")
        elif args.experts % args.ep:
            problems.append(f"--experts {args.experts} is not divisible by --ep {args.ep}: "
                            f"choose ep from {_divisors(args.experts)}")
        if dp % args.ep:
            problems.append(f"--ep {args.ep} borrows data-parallel ranks and must divide "
                            f"dp_replicate*dp_shard = {dp}")
    if args.zero_stage > 0 and dp * cp == 1:
        problems.append(f"--zero-stage {args.zero_stage} shards over data-parallel (and cp) ranks, but there "
                        f"is only one: use --zero-stage 0 or --dp-shard > 1")
    if args.steps < 1 or (args.stop_at is not None and not 1 <= args.stop_at <= args.steps):
        problems.append(f"--steps {args.steps} must be >= 1 and --stop-at between 1 and --steps")
    if args.data is not None and not os.path.isfile(args.data):
        problems.append(f"--data {args.data!r} does not exist: give an existing text file or leave it out")
    elif args.data is not None and os.path.getsize(args.data) < args.seq_len + 1:
        problems.append(f"--data {args.data!r} holds {os.path.getsize(args.data)} bytes (byte tokens), fewer than "
                        f"--seq-len + 1 = {args.seq_len + 1}: give a text of at least {args.seq_len + 1} bytes "
                        f"or a shorter --seq-len")
    if args.resume is not None:
        meta = os.path.join(args.resume, "meta.json")
        if not os.path.isfile(meta):
            problems.append(f"--resume {args.resume!r} holds no checkpoint (meta.json missing)")
        else:
            with open(meta) as f:
                saved = json.load(f)
            last = args.stop_at or args.steps
            if saved["step"] >= last:
                problems.append(f"--resume {args.resume!r} already holds step {saved['step']}, and this run "
                                f"stops at step {last} (--steps{' / --stop-at' if args.stop_at else ''}): "
                                f"nothing is left to train; raise --steps or resume an earlier checkpoint")
            if saved["layout"] != layout_of(args):
                problems.append(f"--resume {args.resume!r} was written with {saved['layout']}; resume with the "
                                f"same sizes, stage, model and dtype (got {layout_of(args)})")
            missing = [r for r in range(world_size) if not os.path.isfile(os.path.join(args.resume, f"rank{r}.pt"))]
            if missing:  # found here, by every rank alike: not by one rank while the others wait
                problems.append(f"--resume {args.resume!r} lacks the shards of ranks {missing}")
    sp = args.sequence_parallel and tp > 1
    if sp and (args.seq_len // cp) % tp:
        problems.append(f"--sequence-parallel splits each rank's {args.seq_len // cp} tokens over tp={tp}: "
                        f"use a --seq-len that is a multiple of {tp * cp * (2 if cp > 1 else 1)}")
    # Combinations the lessons do not compose (yet): said plainly rather than computed wrongly.
    if args.experts and (tp > 1 or cp > 1 or pp > 1):
        unsupported.append("a mixture-of-experts model with tp, cp or pp (experts compose with "
                           "dp_replicate/dp_shard and ep only)")
    if args.experts and args.zero_stage > 0:
        unsupported.append("ZeRO stages 1-3 with experts (expert weights would need their own edp "
                           "shard group): use --zero-stage 0")
    if args.experts and m > 1:
        unsupported.append("micro-batches with experts (the auxiliary loss is defined over a whole batch)")
    if args.zero_stage >= 2 and tp > cfg.n_kv_heads:
        unsupported.append(f"--zero-stage {args.zero_stage} with tp {tp} > n_kv_heads {cfg.n_kv_heads}: "
                           f"replicated kv heads need their gradients summed over tp before the "
                           f"reduce-scatter (use --zero-stage 0 or 1)")
    if sp and pp > 1:
        unsupported.append("--sequence-parallel with pp (stages exchange whole-sequence activations)")
    if sp and args.zero_stage >= 2:
        unsupported.append(f"--sequence-parallel with --zero-stage {args.zero_stage}: the norm weights' "
                           f"gradients must be summed over tp before the reduce-scatter (use 0 or 1)")
    problems += [f"not supported yet: {u}" for u in unsupported]
    if args.compare and (pp > 1 or cp > 1 or args.experts or dp > 1 and args.zero_stage != 3):
        problems.append("--compare runs PyTorch's FSDP2 (ZeRO-3) + DTensor tensor parallel: use only "
                        "--dp-replicate, --dp-shard (zero stage 3) and --tp")
    if problems:
        raise ValueError("invalid training layout:\n  - " + "\n  - ".join(problems))


def lr_at(step: int, args) -> float:
    """Linear warm-up to --lr over --warmup steps, then cosine decay to 10% at --steps (step from 1)."""
    if step <= args.warmup:
        return args.lr * step / max(1, args.warmup)
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ---- building the model for this rank, lesson by lesson ------------------------------------------

def _checkpointed(block):
    """Full activation checkpointing of one block: only its input is saved; the block's forward
    runs again in backward. The wrapper sits INSIDE the module call, so ZeRO-3's hooks (which
    gather the block's parameters around the call) also cover the recomputation."""
    inner = block.forward
    block.forward = lambda h, cos, sin: checkpoint(inner, h, cos, sin, use_reentrant=False)


class Trainer:
    """Everything one rank needs to take a training step of its part of the model."""

    def __init__(self, args, mesh, device):
        self.args, self.mesh, self.device, self.world = args, mesh, device, dist.group.WORLD
        self.cfg = cfg = config_of(args)
        store_dtype = torch.float64 if args.dtype == "float64" else torch.float32
        self.bf16 = args.dtype == "bfloat16"
        self.dp, self.dp_rank = mesh.size("dp"), mesh.rank("dp")
        self.cp, self.cp_rank, self.tp = mesh.size("cp"), mesh.rank("cp"), mesh.size("tp")
        self.use_zero = mesh.size("dp_cp") > 1 and not cfg.n_experts
        # The meta device: shapes only, each rank materialises just its ZeRO-3 shard. The flat
        # units keep an fp32 master for meta parameters, so float64 runs are built for real.
        self.meta = meta = self.use_zero and args.zero_stage == 3 and args.pp == 1 and store_dtype == torch.float32

        # 1. pipeline split
        self.pg = None
        if args.pp > 1:
            from pipeline import SCHEDULES, PipeGroup, Stage
            self.pg = PipeGroup.from_ranks(mesh.ranks("pp"))
            self.actions = SCHEDULES[args.schedule](args.pp, args.microbatches)[self.pg.r]
            model = Stage(cfg, self.pg.r, args.pp, args.seed, device, store_dtype)
        else:
            model = build_model(cfg, seed=args.seed, dtype=store_dtype, device="meta" if meta else device)
        self.is_last = self.pg is None or self.pg.r == args.pp - 1
        blocks = list(model.layers.values() if self.pg is not None else model.layers)
        full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        # 2. tensor parallel
        if self.tp > 1:
            from tensor_parallel import apply_tensor_parallel
            apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=args.sequence_parallel)
        # 3. context parallel
        self.positions = None
        if self.cp > 1:
            import ring_attention as ra
            for block in blocks:
                block.attn.sdpa = ra.ContextParallelAttention(mesh.group("cp"), CP_METHOD, CP_LAYOUT)
            self.positions = ra.shard_positions(args.seq_len, self.cp, self.cp_rank, CP_LAYOUT).to(device)
        if self.pg is not None:
            model.positions = self.positions  # pipeline_step calls the stage without positions
        # 4. expert parallel (also at ep=1 with dp>1: the aux loss then averages over all dp tokens)
        expert = set()
        if cfg.n_experts and self.dp > 1:
            from expert_parallel import ExpertParallelMoE, parallelize_experts
            parallelize_experts(model, mesh)
            expert = {id(p) for mod in model.modules() if isinstance(mod, ExpertParallelMoE)
                      for p in mod.expert_parameters()}
        # 5. activation checkpointing
        if args.activation_checkpointing == "full":
            for block in blocks:
                _checkpointed(block)

        # How many ranks hold a copy of each parameter, so that the global gradient norm counts it
        # once. tp: a slice 1, a kv head shared by t/n_kv ranks t/n_kv, a norm t (an SP norm is
        # "partial" with n = 1). Data parallel: ZeRO stage 0 every dp×cp rank, stages 1-3 the
        # replicas of a master element; without ZeRO every dp rank, an expert its edp ranks.
        named = dict(model.named_parameters())
        ids = {id(p): n for n, p in named.items()}
        partial = {ids[id(p)]: (slot, n) for p, slot, n in getattr(model, "tp_partial_grads", [])}
        zero_dp = mesh.size("dp_cp" if args.zero_stage == 0 else "dp_replicate")

        def copies(n, p):
            tp = self.tp // partial[n][1] if n in partial else 1 if hasattr(p, "tp_slice") else self.tp
            dp = zero_dp if self.use_zero else mesh.size("edp") if id(p) in expert else self.dp
            return tp * dp
        self.copies = {n: copies(n, p) for n, p in named.items()}

        # 6. data parallel / ZeRO / HSDP
        if self.use_zero:
            from fsdp import shard_model
            stage = args.zero_stage
            group = mesh.group("dp_shard_cp" if stage > 0 else "dp_cp")
            rep = mesh.group("dp_replicate") if stage > 0 and mesh.size("dp_replicate") > 1 else None
            # Pipeline: every module with parameters is a unit, so the root unit is empty. fsdp keeps
            # its root gathered from forward until the end of THE backward; a stage runs m backwards.
            units = None if self.pg is None else blocks + [m for m in (
                model.tok_embeddings, getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]

            def init_fn(name, shape):  # my tensor-parallel slice of the parameter's initial value
                full, sl = init_tensor(cfg, name, full_shapes[name], args.seed), getattr(named[name], "tp_slice", None)
                return full.narrow(sl[0], sl[1], sl[2] - sl[1]) if sl else full
            self.opt = shard_model(model, stage, torch.optim.AdamW, group=group, replicate_group=rep,
                                   units=units, param_dtype=torch.bfloat16 if self.bf16 else None,
                                   init_fn=init_fn if meta else None,
                                   max_grad_norm=args.grad_clip or None, lr=args.lr)
            self.opt.clip_grad_norm_ = self._clip_zero  # the global norm over every dimension
            self.inner = self.opt.inner
        else:
            self.opt = self.inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
        if partial:  # shard_model made new Parameters: re-point finish_grads at them
            now = dict(model.named_parameters())
            model.tp_partial_grads = [(now[n], s, k) for n, (s, k) in partial.items()]
        self.model = model

    # ---- gradient norm over the whole model -----------------------------------------------------
    def _clip(self, items, max_norm):
        """items: (gradient, 1/copies). The global norm = sqrt(Σ w·|g|²), one all-reduce over the
        world; then every gradient is scaled by min(1, max_norm / norm), as torch's clip_grad_norm_."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for g, w in items:
            sq += g.double().pow(2).sum() * w
        dist.all_reduce(sq, group=self.world)
        self.grad_norm = norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g, _ in items:
            g.mul_(coef.to(g.dtype))
        return norm

    def _clip_zero(self, max_norm):
        """ZeroOptimizer's clip hook: its master gradients are my slice of each unit's flat buffer."""
        items = []
        for u in self.opt.units:
            g = u.master.grad
            if g is None:
                continue
            lo = 0 if self.opt.stage == 0 else u.r * u.n
            for name, off, k in zip(u.names, u.offsets(), u.numels):
                a, b = max(off, lo), min(off + k, lo + g.numel())
                if a < b:
                    items.append((g[a - lo:b - lo], 1.0 / self.copies[name]))
        # padding elements are left out: their gradient is zero, and stays zero
        self.opt.grad_norm = self._clip(items, max_norm)
        return self.grad_norm

    # ---- one optimizer step -------------------------------------------------------------------------
    def batch(self, step: int, tokens):
        """This rank's slice of the global batch of `step` (0-based): dp rows, cp tokens."""
        a = self.args
        x, y = get_batch(tokens, step, a.global_batch_size, a.seq_len, a.seed, self.dp_rank, self.dp,
                         device=self.device)
        if self.cp > 1:
            from ring_attention import shard_sequence
            x, y = (shard_sequence(t, self.cp, self.cp_rank, CP_LAYOUT) for t in (x, y))
        return x, y

    def step(self, step: int, tokens) -> torch.Tensor:
        """Forward, backward, gradient reduction, clipping, AdamW. Returns this rank's local loss
        (the mean over its tokens; zero on ranks that do not compute it)."""
        a, model, m = self.args, self.model, self.args.microbatches
        for g in self.inner.param_groups:
            g["lr"] = lr_at(step + 1, a)
        x, y = self.batch(step, tokens)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16 and not self.use_zero):
            if self.pg is not None:
                from pipeline import pipeline_step
                loss = pipeline_step(model, self.actions, self.pg, x, y, m, None, measure=False)["loss"]
            else:
                loss = 0.0
                for xm, ym in zip(x.chunk(m), y.chunk(m)):  # gradient accumulation
                    lm = model(xm, ym, positions=self.positions)
                    (lm / m).backward()
                    loss = loss + lm.detach() / m
        if self.tp > 1:
            from tensor_parallel import finish_grads
            finish_grads(model)  # sums partial gradients: replicated kv heads, SP norms (else no-op)
        if not self.use_zero:    # (ZeroOptimizer.step reduces, clips and steps: stage 0/1 here, 2/3 in backward)
            if self.cfg.n_experts and self.dp > 1:
                from expert_parallel import sync_gradients
                sync_gradients(model, self.mesh.group("dp"), self.mesh.group("edp"), self.dp)
            if a.grad_clip:
                self._clip([(p.grad, 1.0 / self.copies[n]) for n, p in model.named_parameters()
                            if p.grad is not None], a.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return torch.zeros((), device=self.device) if loss is None else loss.detach()

    def global_loss(self, local: torch.Tensor) -> float:
        """Mean over the dp×cp ranks of the last stage (tp ranks agree: count tp rank 0 only)."""
        counts = self.is_last and self.mesh.rank("tp") == 0
        v = torch.tensor(float(local) / (self.dp * self.cp) if counts else 0.0, dtype=torch.float64,
                         device=self.device)
        dist.all_reduce(v, group=self.world)
        return v.item()

    def state_bytes(self) -> dict:
        from instruments import model_state_bytes
        return self.opt.state_bytes() if self.use_zero else model_state_bytes(self.model.parameters(), self.opt)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save(self, path: str, step: int) -> None:
        """Each rank writes its own shards; rank 0 writes meta.json LAST (a complete checkpoint)."""
        os.makedirs(path, exist_ok=True)
        params = [u.master.detach().cpu() for u in self.opt.units] if self.use_zero else \
            {k: v.cpu() for k, v in self.model.state_dict().items()}
        cuda = self.device.type == "cuda"
        torch.save(dict(step=step, params=params, optimizer=self.inner.state_dict(), rng=torch.get_rng_state(),
                        cuda_rng=torch.cuda.get_rng_state(self.device) if cuda else None),
                   os.path.join(path, f"rank{dist.get_rank()}.pt"))
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(path, "meta.json"), "w") as f:
                json.dump(dict(step=step, world_size=dist.get_world_size(), layout=layout_of(self.args)), f)
        dist.barrier()

    @torch.no_grad()
    def load(self, path: str) -> int:
        state = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), map_location=self.device,
                           weights_only=False)
        if self.use_zero:
            for u, saved in zip(self.opt.units, state["params"]):
                u.master.copy_(saved)
                u.publish()  # my compute copy from the master; stages 1-2 gather everyone's slices
        else:
            self.model.load_state_dict(state["params"])
        self.inner.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return state["step"]


# ---- the loop ---------------------------------------------------------------------------------------

def _peak_memory(device) -> int:
    """CUDA allocator peak on a GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _peak_flops(device) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def train(args, device=None, verbose: bool = True) -> dict:
    """Train on every rank of an initialised process group. Returns (on every rank) the global
    losses per step and this rank's measurements."""
    from instruments import CommCounter
    from mesh import Mesh
    device = device or torch.device("cpu")
    check_args(args, dist.get_world_size())                    # every rank, before any collective
    mesh = Mesh(**{d: getattr(args, d) for d in DIMS}, ep=args.ep)
    tokens = load_corpus(args.data)
    trainer = Trainer(args, mesh, device)
    start = trainer.load(args.resume) if args.resume else 0
    rank0, world, cuda = dist.get_rank() == 0, dist.get_world_size(), device.type == "cuda"
    fpt = flops_per_token(trainer.cfg, args.seq_len)
    peak = _peak_flops(device) if args.dtype == "bfloat16" else None
    if verbose and rank0:
        print(f"train.py: {mesh}, zero stage {args.zero_stage}, model {args.model} "
              f"({num_params(trainer.cfg):,} parameters), {args.dtype}, global batch "
              f"{args.global_batch_size}x{args.seq_len}, {device}"
              + (f", resuming after step {start}" if start else ""), flush=True)
    out = dict(losses=[], tokens_per_s=[], comm_bytes=[], peak_memory_bytes=[], grad_norms=[], start=start)
    last = args.stop_at or args.steps
    for s in range(start, last):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        # One process has nothing to count, and a dispatch mode sees every op: leave it off there.
        comm = CommCounter()
        with comm if world > 1 else contextlib.nullcontext():
            local = trainer.step(s, tokens)
        if cuda:
            torch.cuda.synchronize(device)
        tps = args.global_batch_size * args.seq_len / (time.perf_counter() - t0)
        loss, lr, mem, nbytes = trainer.global_loss(local), lr_at(s + 1, args), _peak_memory(device), comm.bytes()
        mfu = fpt * tps / (peak * world) if peak else None
        norm = getattr(trainer, "grad_norm", None)
        for k, v in [("losses", loss), ("tokens_per_s", tps), ("comm_bytes", nbytes), ("peak_memory_bytes", mem),
                     ("grad_norms", None if norm is None else float(norm))]:
            out[k].append(v)
        if rank0 and verbose and not args.quiet:
            print(f"step {s + 1:4d}  loss {loss:.6f}  lr {lr:.2e}  {tps:10.0f} tokens/s"
                  + (f"  MFU {mfu:5.1%}" if mfu is not None else "")
                  + f"  peak mem {mem / 2**20:8.1f} MiB  comm {nbytes / 2**20:8.3f} MiB (rank 0)", flush=True)
        if rank0 and args.log_file:
            with open(args.log_file, "a") as f:
                f.write(json.dumps(dict(step=s + 1, loss=loss, lr=lr, tokens_per_s=tps, peak_memory_bytes=mem,
                                        comm_bytes=nbytes, mfu=mfu)) + "\n")
    out.update(comm_summary=comm.summary() if last > start else {}, state_bytes=trainer.state_bytes(),
               coords=dict(mesh.coords), meta_init=trainer.meta)
    if trainer.use_zero:  # the flat units' padded sizes, for the ZeRO formulas (fsdp.py)
        out["zero_units"] = [(u.N, u.names[0]) for u in trainer.opt.units]
    if args.save:
        trainer.save(args.save, last)
    if args.check:
        ok = torch.ones((), device=device)
        if rank0:
            want = single_process_losses(args, range(start, last), device)
            err = max(abs(a - b) for a, b in zip(out["losses"], want))
            tol = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2}[args.dtype]
            ok.fill_(float(err < tol))
            print(f"losses vs the single-process run: max |diff| {err:.2e} (tolerance {tol}) -> "
                  f"{'ok' if err < tol else 'MISMATCH'}", flush=True)
        dist.all_reduce(ok)
        out["check_ok"] = ok.item() > 0
    return out


def single_process_losses(args, steps: range, device=None) -> list[float]:
    """The reference: model.py's model in one process on the whole global batch, AdamW with
    torch's own clip_grad_norm_ and the same learning rate (bf16 runs are compared with fp32)."""
    model = build_model(config_of(args), seed=args.seed, device=device,
                        dtype=torch.float64 if args.dtype == "float64" else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tokens, losses = load_corpus(args.data), []
    for s in range(steps.stop):
        for g in opt.param_groups:
            g["lr"] = lr_at(s + 1, args)
        loss = model(*get_batch(tokens, s, args.global_batch_size, args.seq_len, args.seed, device=device or "cpu"))
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses[steps.start:]


def run_layouts(layouts: list[list[str]], common: list[str] = ()) -> list[dict]:
    """A rank function (launch.run_ranks): train each layout in turn on the same ranks; every
    layout's flags are `common + layout`. Returns each layout's result on this rank."""
    return [dict(train(parse_args([*common, *flags, "--quiet"]), verbose=False), flags=" ".join(flags))
            for flags in layouts]


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main(argv=None, compare=None) -> int:
    """torchrun entry point. compare(args, device) -> (losses, seconds per step): PyTorch's own
    FSDP2 + DTensor run of the same layout, defined below the __main__ line (--compare)."""
    args = parse_args(argv)
    try:
        check_args(args, int(os.environ.get("WORLD_SIZE", "1")))  # before joining: every rank alike, no hang
    except ValueError as e:
        print(f"[rank {os.environ.get('RANK', '0')}] {e}", file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # torchrun stops every rank once one exits: linger a moment, so that the slower
            # ranks reach this same check and say it too (no collective needed, none hangs).
            time.sleep(3)
        return 2
    from mesh import init_distributed
    device = init_distributed()
    try:
        out = train(args, device)
        if args.compare and compare is not None:
            t_ours = _median(args.global_batch_size * args.seq_len / t for t in out["tokens_per_s"][1:]
                             or out["tokens_per_s"])
            theirs, step_time = compare(args, device)
            err = max(abs(a - b) for a, b in zip(out["losses"], theirs))
            if dist.get_rank() == 0:
                print(f"PyTorch FSDP2 + DTensor TP, same layout: max |loss diff| {err:.2e}; median step "
                      f"{t_ours * 1e3:.1f} ms (ours) vs {step_time * 1e3:.1f} ms (PyTorch) -> our throughput "
                      f"{step_time / t_ours:.2f}x PyTorch's", flush=True)
    finally:
        dist.destroy_process_group()
    return 0 if out.get("check_ok", True) else 1


if __name__ == "__main__":
    # PyTorch's own wrappers appear only here, as the reference --compare runs beside ours.
    def pytorch_fsdp2_tp(args, device):
        """The same model, batches, AdamW, schedule and clipping under fully_shard + parallelize_module."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        shape = (args.dp_replicate, args.dp_shard, args.tp)  # the same row-major order as mesh.py
        dm = init_device_mesh(device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        model = build_model(get_config(args.model), seed=args.seed, device=device,
                            dtype=torch.float64 if args.dtype == "float64" else torch.float32)
        if args.tp > 1:
            cols = ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")  # then rows: attn.wo, mlp.w2
            plan = {f"layers.{i}.{n}": ColwiseParallel() if n in cols else RowwiseParallel()
                    for i in range(len(model.layers)) for n in cols + ("attn.wo", "mlp.w2")}
            plan.update(tok_embeddings=RowwiseParallel(input_layouts=Replicate()),
                        output=ColwiseParallel(output_layouts=Replicate()))
            parallelize_module(model, dm["tp"], plan)
        if args.dp_replicate * args.dp_shard > 1:
            dp_mesh = dm["dp_replicate", "dp_shard"] if args.dp_replicate > 1 else dm["dp_shard"]
            for block in model.layers:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        tokens, losses, times = load_corpus(args.data), [], []
        dp, dp_rank = args.dp_replicate * args.dp_shard, dist.get_rank() // args.tp
        for s in range(args.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(s + 1, args)
            x, y = get_batch(tokens, s, args.global_batch_size, args.seq_len, args.seed, dp_rank, dp, device=device)
            t0 = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            if args.grad_clip:  # parameters live on different meshes: the global norm by hand
                sq = torch.zeros((), dtype=torch.float64, device=device)
                world = dist.get_world_size()
                for p in model.parameters():
                    g, copies = p.grad, world  # a plain tensor: the same on every rank
                    if hasattr(g, "to_local"):  # copies: ranks outside its mesh, and replicated mesh dims
                        copies = world // g.device_mesh.size() * math.prod(
                            g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
                        g = g.to_local()
                    sq += g.double().pow(2).sum() / copies
                dist.all_reduce(sq)
                coef = (args.grad_clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)
                for p in model.parameters():
                    p.grad.mul_(coef.item())
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            v = loss.detach().double() / dp if args.tp == 1 or dist.get_rank() % args.tp == 0 else \
                torch.zeros((), dtype=torch.float64, device=device)
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            dist.all_reduce(v)
            losses.append(v.item())
        return losses, _median(times[1:] or times)

    sys.exit(main(compare=pytorch_fsdp2_tp))
