"""Capstone — every strategy composed by mesh sizes, with the same losses as one process on every layout.

    torchrun --nproc_per_node N train.py --pp P --dp-replicate R --dp-shard D --cp C --tp T [--ep E]

The mesh is [pp, dp_replicate, dp_shard, cp, tp] (mesh.py), P·R·D·C·T = N; expert parallel borrows E
of the R·D data-parallel ranks. For a fixed seed and global batch every layout computes the losses
of one process. The global batch of step s is drawn from (seed, s) alone; data-parallel rank d takes
its rows, context-parallel rank c its zigzag chunks of every sequence, and the pipeline (or gradient
accumulation) cuts a rank's rows into m micro-batches. The loss is the mean over every COUNTED token
of the global batch (padded targets count nowhere, --pad-share):

    L = Σ_t CE_t / N_count          N_count: counted targets of the global batch, which every rank
                                    computes from (seed, s) alone — no communication

Each rank's micro-batch loss is its own SUM of CE over its counted tokens divided by N_count/(dp·cp·m);
after the 1/m of accumulation, the data-parallel average over the dp·cp ranks (sum, then ÷ dp·cp) is
exactly ∇L — also when ranks hold different numbers of counted tokens, where the mean of the ranks'
mean losses would weigh a token on a sparsely filled rank more than one on a full rank. (With experts
the auxiliary load-balancing loss is per forward: over one micro-batch's tokens on every rank.)

The order the lessons are applied in (each sees the model the one before left; Trainer.__init__ makes
one call per step):
  1. pipeline split   pipeline.Stage: cuts whole layers (v chunks per rank when interleaved), so it
                      must see the unmodified model; everything after works on this rank's layers
  2. compile          torch.compile of each block, before anything swaps its parts or hooks it (--compile)
  3. tensor parallel  tensor_parallel.apply_tensor_parallel: slices the weights of the layers kept
  4. float8           lab.model.use_float8: each linear's matmul in float8, the weights as they are (--float8)
  5. context parallel ring_attention.ContextParallelAttention in each block's attn.sdpa (ring, Ulysses,
                      or Ulysses inside a ring): only the attention core changes, whatever tp did to heads
  6. expert parallel  expert_parallel.parallelize_experts: each MoE dispatches its tokens over the ep
                      group; under tp each tp rank takes 1/tp of the (replicated) tokens, so a token
                      goes to the experts once, not tp times
  7. checkpointing    --activation-checkpointing selective (keep the matmul and attention outputs,
                      recompute the rest) or full (keep each block's input, recompute its forward), inside
                      ZeRO-3's gather hooks; with zero bubble the recompute splits its backward again
  8. ZeRO / HSDP      fsdp.shard_model (stage 0) or hsdp.shard_hybrid (stages 1-3), last: it flattens,
                      shards and reduces exactly the parameters the steps above left on this rank —
                      dense ones over dp_shard×cp (replicas across dp_replicate), expert ones over
                      edp_cp (every copy of my experts). At stage 0 lesson 1's ddp.BucketedDDP
                      all-reduces the gradients in buckets over dp×cp (experts: edp_cp) while the last
                      backward of the step runs, and ZeRO-0 reduces nothing: it packs and steps

Gradients. Dense: Σ over dp·cp ranks, ÷ dp·cp. Experts: the backward all-to-all already summed the
ep group's contributions on the expert's owner, so Σ over edp_cp, ÷ dp·cp too (÷ |edp_cp| = dp·cp/ep
would count each rank's tokens ep times). Partial over tp (replicated kv heads when tp > n_kv_heads,
sequence-parallel norms, a MoE's router and experts whose tp ranks saw different tokens): summed over
tp first, unit by unit, right before ZeRO reduces them (fsdp's before_reduce; at ZeRO-0 right after
data parallel averaged them — a sum over tp and one over dp·cp commute). Clipping uses the
norm of the WHOLE model: each rank adds the squares of the gradient elements it holds, weighted by
1/(ranks holding a copy), one all-reduce over the world — each element counted once.

Communication and memory per step are the lessons' formulas, each on its own group, with this rank's share
(Ψ' = the parameters of my stage's tp slice, Ψ'_E of them expert weights; B' = B/dp rows; S' = S/cp tokens):
ZeRO / HSDP (fsdp.py, hsdp.py) over dp_shard·cp with replicas across dp_replicate, experts over edp_cp on Ψ'_E
with expert_parallel.py's all-to-alls; tp (tensor_parallel.py) on [B', S', H]; pp (pipeline.py) per stage
boundary; cp (ring_attention.py) per layer; clipping one all-reduce of one float64 over the world. One thing is
new here: a pipeline keeps ZeRO-3's units gathered over its m micro-batches, so each is gathered and
reduce-scattered once per step, not m times. Model state per rank is fsdp.py's stage table on Ψ' − Ψ'_E over
dp_shard·cp and on Ψ'_E over dp·cp/ep, plus the norm weights every tp rank keeps whole.

This file is the composition and its command line: `Trainer` (this rank's part of the model, steps 1-8,
one step, checkpoints), `train` (the loop), the steps' functions, then `parse_args` and `check_args`
(every invalid layout named from the arguments alone, by the lessons' own checks, before any collective).
What measures it — time, bytes, memory per step, the per-step lines, --check and --compare — attaches from outside
(lab/train_demo.py, which `python train.py` and `torchrun ... train.py` run):
    --check    afterwards rank 0 trains the model in ONE process (lab.baseline.single_process) and compares; where
               they differ, lab/mismatch.py says at which step and place, on which rank, in what pattern
    --compare  afterwards the same layout under PyTorch's FSDP2 + DTensor TP, losses and step times
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn
from torch.utils.checkpoint import checkpoint as recompute

import ddp
import expert_parallel
import fsdp
import hsdp
import pipeline
import ring_attention
import tensor_parallel
from lab import checkpoint, collective_watch, hf
from lab.data import IGNORE, get_batch, load_corpus
from lab.model import CONFIGS, build_model, get_config, init_tensor, use_float8
from mesh import DIMS, Mesh, mesh_problems

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
CP_LAYOUT = "zigzag"  # how context parallel splits a sequence (ring_attention.py): balanced causal work


# ---- this rank's part of the model, lesson by lesson -------------------------------------------------

class Trainer:
    """Everything one rank needs to take a training step of its part of the model."""

    def __init__(self, args, mesh: Mesh, device, shapes_only: bool = False):
        """Steps 1-8, each one call, in the order of the module doc. Every layout is built on the meta device:
        shapes only, until ZeRO (8) makes each rank's flat units from init_fn — its stage's layers, its tp slice,
        its experts and (ZeRO-3) its shard of those: no rank ever holds the whole model. shapes_only: it stays
        there, no values, no memory — the real sharded model's sizes for a memory plan (lab/plan.py)."""
        self.args, self.mesh, self.device = args, mesh, torch.device("meta") if shapes_only else device
        self.cfg, self.m = config_of(args), args.microbatches
        self.dp, self.cp, self.tp = mesh.size("dp"), mesh.size("cp"), mesh.size("tp")
        sp = args.sequence_parallel and self.tp > 1
        model, self.pipe, self.actions = split_pipeline(args, mesh, self.cfg)                      # 1
        # (a tied head under both its names: the whole model's shapes of every name a parameter has here)
        blocks = layers_of(model)
        full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        # a head tied to the embedding on the first and the last stage: their gradients summed (pipeline.py, 7.)
        self.tied = (pipeline.tied_embedding_groups(mesh.groups_along(("pp",)))
                     if self.pipe is not None and self.cfg.tie_embeddings else None)
        if args.compile and not shapes_only:                                                          # 2
            compile_blocks(blocks, args.compile_backend)
        if self.tp > 1:                                                                               # 3
            tensor_parallel.apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=sp)
        if args.float8:                                                                               # 4
            use_float8(model)
        self.positions = apply_context_parallel(model, blocks, args, mesh, self.device)              # 5
        experts = apply_expert_parallel(model, mesh, sp) if self.cfg.n_experts else set()            # 6
        if args.activation_checkpointing != "none":                                                   # 7
            for block in blocks:
                _checkpointed(block, args.activation_checkpointing)
        # (read before ZeRO replaces the parameters: how many ranks hold each gradient element, and where each
        #  parameter this rank holds sits in the whole model's — a tp slice, my experts, or all of it)
        self.copies = {n: self._copies(model, n, p, experts) for n, p in model.named_parameters()}
        self.places = {n: (full_shapes[n], getattr(p, "tp_slice", None) or getattr(p, "ep_slice", None))
                       for n, p in model.named_parameters(remove_duplicate=False)}
        self.opt, self.ddp = shard(model, args, mesh, full_shapes, experts, self.pipe is not None, shapes_only)  # 8
        self.model, self.loss_fn = model, getattr(model, "loss_fn", None)  # a pipeline: its last stage only
        self.grad_norm = None

    def step(self, step: int, tokens) -> torch.Tensor:
        """Forward, backward, reduction, clipping, AdamW. Returns this rank's share of the global loss
        (summed over the ranks of one tp group's rank 0, it is the global loss). The gradients are
        cleared when the next step begins, so between steps they can be read (and measured)."""
        a, model, m = self.args, self.model, self.m
        self.opt.zero_grad(set_to_none=True)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step + 1, a)
        x, y, counted = self.batch(step, tokens)
        if self.loss_fn is not None:  # Σ CE / divide_by per micro-batch; ÷m, then ÷dp·cp: Σ CE / counted
            self.loss_fn.divide_by = max(counted, 1) / (self.dp * self.cp * m)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        # Several backwards per step (micro-batches, a pipeline): ZeRO reduces once, after the last one
        # (and zero bubble's deferred W); one backward: ZeRO-2/3 reduce unit by unit during it.
        # ZeRO-0: data parallel's buckets all-reduce during the last backward only (the others add up locally)
        several, dp = self.pipe is not None or m > 1, self.ddp
        with self.opt.accumulating() if several else nullcontext():
            if self.pipe is not None:
                if dp is not None:
                    dp.sync_next_backward(False)
                out = pipeline.pipeline_step(model, self.actions, self.pipe, x, y, m, trace=_micro_batch,
                                             before_last_backward=dp and dp.sync_next_backward)
                loss += sum(v.double() for v in (out["loss"], out["aux"]) if v is not None)
            else:
                for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):  # gradient accumulation
                    with collective_watch.context(f"micro-batch {i + 1} of {m}") if m > 1 else nullcontext():
                        lm = model(xm, ym, positions=self.positions)
                        if dp is not None:
                            dp.sync_next_backward(i == m - 1)
                        (lm / m).backward()
                    loss += lm.detach().double() / m
        if dp is not None:
            dp.synchronize()          # (nothing left, unless no gradient reached a hook in the last backward)
        pipeline.sync_tied_embedding(model, self.tied)   # (a tied head: first + last stage; None: nothing)
        self.opt.reduce_gradients()   # (tp partial sums first, unit by unit: before_reduce)
        if a.grad_clip:
            self.grad_norm = self.opt.clip_grad_norm_(a.grad_clip, group=dist.group.WORLD,
                                                      weight_of=lambda n: 1.0 / self.copies[n])
        self.opt.step()
        return loss / (self.dp * self.cp)

    def batch(self, step: int, tokens):
        """This rank's rows (dp) and tokens (cp) of the global batch of `step`, and the global batch's
        number of counted targets (every rank draws the same global batch: no communication)."""
        a = self.args
        x, y = get_batch(tokens, step, a.global_batch_size, a.seq_len, a.seed, pad_share=a.pad_share)
        counted = int((y != IGNORE).sum())
        x, y = (t.chunk(self.dp)[self.mesh.rank("dp")].to(self.device) for t in (x, y))  # my rows
        if self.cp > 1:
            x, y = (ring_attention.shard_sequence(t, self.cp, self.mesh.rank("cp"), CP_LAYOUT) for t in (x, y))
        return x, y, counted

    def global_loss(self, share: torch.Tensor) -> float:
        """Σ of the ranks' shares (tp ranks hold the same numbers: tp rank 0 counts for its group)."""
        v = share.clone() if self.mesh.rank("tp") == 0 else torch.zeros_like(share)
        dist.all_reduce(v)
        return v.item()

    def _copies(self, model, name, p, expert_names) -> int:
        """How many ranks hold the same reduced gradient element of `name` (it counts once in the norm):
        tp — a slice 1, a kv head shared by t/n_kv ranks t/n_kv, a whole tensor (norm, router) t;
        data — stage 0 every rank that reduced it, stages 1-3 the replicas of a master slice."""
        partial = getattr(model, "tp_partial_grads", None) or {}
        if name in partial:  # summed over tp into n_slots slots: tp/n_slots ranks hold each
            tp = self.tp // partial[name][1]
        elif hasattr(p, "tp_slice"):
            tp = 1
        else:
            tp = self.tp
        if name in expert_names:
            data = self.mesh.size("edp_cp") if self.args.zero_stage == 0 else 1
        else:
            data = self.mesh.size("dp_cp") if self.args.zero_stage == 0 else self.mesh.size("dp_replicate")
        tied = 2 if self.tied is not None and name == "tok_embeddings.weight" else 1  # the first and last stage's
        return tp * data * tied

    # ---- checkpoints (lab/checkpoint.py: the pieces any layout can load, and the files) ----------
    def where(self, name):
        """(the whole parameter's shape, the narrow this rank holds of it: a tp slice, my experts, or None)."""
        return self.places[name]

    def save(self, root: str, step: int) -> tuple[str, int]:
        return checkpoint.save(self.opt, self.where, root, step, layout=layout_of(self.args),
                               shapes=model_shapes(self.args), keep=self.args.keep)

    def load(self, path: str) -> int:
        return checkpoint.load(self.opt, self.where, path)

    def export(self, path: str) -> None:
        if self.args.export_format == "hf":  # a Hugging Face directory (its tokenizer from --init-from's, if any)
            checkpoint.export_hf(self.opt, self.where, path, cfg=self.cfg, shapes=model_shapes(self.args),
                                 dtype=store_dtype(self.args), device=self.device, copy_from=self.args.init_from)
            return
        plain = build_model(config_of(self.args), device="meta")  # its state_dict's names, a tied weight's each
        first = {id(p): n for n, p in plain.named_parameters()}
        names = {n: first[id(t)] for n, t in plain.state_dict(keep_vars=True).items()}
        checkpoint.export(self.opt, self.where, path, shapes=model_shapes(self.args), names=names,
                          dtype=store_dtype(self.args), device=self.device)

    def init_from(self, path: str, read: str = "every-rank") -> int:
        """Start from a plain state dict or a Hugging Face directory; returns the bytes this rank read."""
        return checkpoint.init_from(self.opt, self.where, path, read, dtype=store_dtype(self.args),
                                    device=self.device)


# ---- the loop ------------------------------------------------------------------------------------------

def train(args, device=None, observer=None) -> dict:
    """Train on every rank of an initialised process group; returns (on every rank) the global loss of
    each step and the first step (after --resume). `observer` attaches measurement from outside
    (lab.train_demo.StepMeter): observer.begin(trainer, start) once, observer.around(trainer, step)
    entered around each step's computation, observer.after(trainer, step, loss) once its loss is known.
    The flags that report (--check, --compare, --log-file, --quiet) are the runner's: lab/train_demo.py."""
    device = device or torch.device("cpu")
    check_args(args, dist.get_world_size())                    # every rank, before any collective
    mesh = Mesh(**{d: getattr(args, d) for d in DIMS}, ep=args.ep)
    tokens = load_corpus(args.data, tokenizer=checkpoint.tokenizer_of(args.init_from))  # bytes, or the model's
    trainer = Trainer(args, mesh, device)
    resume = resume_path(args)  # --resume auto: the newest checkpoint under --save, or None on a first attempt
    start = trainer.load(resume) if resume else 0
    if resume is None and args.init_from:
        trainer.init_from(args.init_from, args.init_read)
    if observer is not None:
        observer.begin(trainer, start)
    losses, last = [], args.stop_at or args.steps
    for s in range(start, last):
        with observer.around(trainer, s) if observer is not None else nullcontext():
            share = trainer.step(s, tokens)
        losses.append(trainer.global_loss(share))
        if args.save and (s + 1 == last or args.save_every and (s + 1) % args.save_every == 0):
            trainer.save(args.save, s + 1)
        if observer is not None:
            observer.after(trainer, s, losses[-1])
    if args.export:
        trainer.export(args.export)
    return dict(losses=losses, start=start, resumed_from=resume)


# ---- the steps, one function each (Trainer.__init__ calls them in order) ---------------------------------

def split_pipeline(args, mesh: Mesh, cfg):
    """1. This rank's layers (v chunks when interleaved), named as in the whole model, on the meta device; with
    pp = 1 the whole model. Returns (model, PipeGroup or None, this rank's schedule actions or None)."""
    store = store_dtype(args)
    if args.pp == 1:
        return build_model(cfg, seed=args.seed, dtype=store, device="meta"), None, None
    pipe = pipeline.PipeGroup.from_ranks(mesh.ranks("pp"))
    actions = pipeline.SCHEDULES[args.schedule](args.pp, args.microbatches, args.virtual_stages)[pipe.r]
    return pipeline.Stage(cfg, pipe.r, args.pp, args.seed, "meta", store, v=args.virtual_stages), pipe, actions


def layers_of(model) -> list:
    """The blocks this rank holds (a model's ModuleList, a pipeline stage's ModuleDict)."""
    return list(model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers)


def compile_blocks(blocks, backend: str) -> None:
    """2. torch.compile each block's forward before anything below swaps its parts or hooks it: it is traced at
    its first call, with the parts it has then, and breaks its graph where a collective runs."""
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)


def apply_context_parallel(model, blocks, args, mesh: Mesh, device):
    """5. Only the attention core changes: each block's attn.sdpa becomes ring attention, Ulysses, or Ulysses
    inside groups of --cp-ulysses ranks with a ring across them. Returns this rank's token positions (None
    without cp). A pipeline stage is called without positions, and under sequence parallel its input holds S/tp
    tokens: it keeps the positions of all S."""
    positions = None
    if mesh.size("cp") > 1:
        u, cp = args.cp_ulysses, mesh.size("cp")
        ring, group = (ring_attention.ring_ulysses_groups(mesh.groups_along(("cp",)), u) if 1 < u < cp
                       else (None, mesh.group("cp")))
        for block in blocks:
            block.attn.sdpa = ring_attention.ContextParallelAttention(group, "ulysses" if u > 1 else "ring",
                                                                      CP_LAYOUT, ring_group=ring)
        positions = ring_attention.shard_positions(args.seq_len, cp, mesh.rank("cp"), CP_LAYOUT).to(device)
    if args.pp > 1:
        model.positions = positions if positions is not None else torch.arange(args.seq_len, device=device)
    return positions


def apply_expert_parallel(model, mesh: Mesh, sequence_parallel: bool) -> set:
    """6. Each MoE dispatches its tokens over the ep group (under tp each tp rank 1/tp of them, so a token goes to
    the experts once, not tp times). Returns the expert parameters' names; under tp their gradients and the
    router's are partial (each tp rank routed its own tokens), marked for tensor_parallel.finish_grads."""
    expert_parallel.parallelize_experts(model, mesh, sequence_parallel=sequence_parallel)
    name_of = {id(p): n for n, p in model.named_parameters()}
    if mesh.size("tp") > 1:
        for p in expert_parallel.tp_partial_parameters(model):
            tensor_parallel.mark_partial(model, name_of[id(p)])
    return {name_of[id(p)] for p in expert_parallel.expert_parameters(model)}


def shard(model, args, mesh: Mesh, full_shapes: dict, experts: set, pipelined: bool, shapes_only: bool):
    """8. ZeRO / HSDP, last: it flattens, shards and reduces exactly the parameters the steps before left on this
    rank — dense ones over dp_shard × cp (replicas across dp_replicate), expert ones over edp_cp (every copy of
    my experts), all gradients divided by dp·cp. Returns (optimizer, ddp.BucketedDDP or None).
    Who reduces what at ZeRO-0: ddp.BucketedDDP all-reduces every gradient over dp × cp in buckets during the
    step's last backward (lesson 1); shard_model(0, Seams(averaged=True)) then reduces nothing: it packs the
    averaged gradients into its flat units (tp's partial sums added first) and steps."""
    cfg, dp_cp = config_of(args), mesh.size("dp") * mesh.size("cp")
    named = dict(model.named_parameters())

    def init_fn(name, shape):  # my tp slice (or my experts) of the parameter's initial value
        full, p = init_tensor(cfg, name, full_shapes[name], args.seed), named[name]
        sl = getattr(p, "tp_slice", None) or getattr(p, "ep_slice", None)
        return full.narrow(sl[0], sl[1], sl[2] - sl[1]) if sl else full

    def groups_of(name, p):
        return (mesh.group("edp_cp"), dp_cp) if name in experts else None

    def before_reduce(params):  # tp's partial gradients summed, unit by unit, right before ZeRO reduces them
        tensor_parallel.finish_grads(model, params)

    partial = mesh.size("tp") > 1 and bool(getattr(model, "tp_partial_grads", None))
    seams = fsdp.Seams(divide_by=dp_cp, groups_of=groups_of if experts else None,
                       before_reduce=before_reduce if partial else None, shapes_only=shapes_only)
    zero = dict(units=_pipeline_units(model) if pipelined else None,
                reshard_after_forward=not pipelined,  # a pipeline keeps units gathered over its micro-batches
                param_dtype=torch.bfloat16 if args.dtype == "bfloat16" else None,
                init_fn=None if shapes_only else init_fn, offload=args.offload, lr=args.lr)
    if args.zero_stage > 0:  # sharded over dp_shard x cp, replicas across dp_replicate (HSDP when > 1)
        return hsdp.shard_hybrid(model, stage=args.zero_stage, shard_group=mesh.group("dp_shard_cp"),
                                 replicate_group=mesh.group("dp_replicate"), seams=seams, **zero), None
    averaged = dp_cp > 1 and not shapes_only
    opt = fsdp.shard_model(model, 0, torch.optim.AdamW, group=mesh.group("dp_cp"),
                           seams=dataclasses.replace(seams, averaged=averaged), **zero)
    if not averaged:
        return opt, None
    # (wrapped after ZeRO flattened the parameters: its hooks are on the views ZeRO made)
    return opt, ddp.BucketedDDP(model, mesh.group("dp_cp"), args.bucket_mb, min(1, args.bucket_mb),
                                reduce_dtype=torch.float32 if args.dtype == "bfloat16" else None,
                                divide_by=dp_cp, groups_of=groups_of if experts else None)


# ---- what the steps use: activation checkpointing, a pipeline's ZeRO units --------------------------------

def _micro_batch(group):
    """What a pipeline's group of actions belongs to, for --watch's lines: "SEND_F of micro-batch 2, RECV_B of
    micro-batch 1"."""
    return collective_watch.context(", ".join(f"{a.op} of micro-batch {a.mb + 1}" + (f" (chunk {a.chunk})" if a.chunk
                                                                                       else "") for a in group))


# Selective activation checkpointing keeps the outputs of these ops — the matmuls and attention, which
# cost the most to recompute — and recomputes everything else of a block in backward (the norms, rotary,
# SwiGLU's silu and product, the residual adds: cheap, and together most of the bytes). Change the list
# and watch the activation bytes and the step time move (lab/train_demo.py's activation_profile).
SAVED_BY_SELECTIVE = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default] + [
    getattr(torch.ops.aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)]


def _selective(ctx, op, *args, **kwargs):
    """The selective policy: keep what SAVED_BY_SELECTIVE's ops return where autograd records them — not inside
    an autograd.Function's own forward, which runs without grad and saves what its backward needs itself
    (ring attention's blocks: kept, their S/cp × S/cp scores would outweigh everything selective saves)."""
    keep = op in SAVED_BY_SELECTIVE and torch.is_grad_enabled()
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(block, how: str):
    """Activation checkpointing of one block, `full`: only its input is kept, its whole forward runs again in
    backward; `selective`: PyTorch's selective-checkpoint contexts also keep what SAVED_BY_SELECTIVE's ops
    return, and the recompute replays those from memory. The wrapper sits INSIDE the module call, so
    ZeRO-3's gather hooks cover the recompute."""
    inner = block.forward

    def contexts():  # (around the forward, around its recompute in backward; under zero bubble the recompute
        #  runs inside B's DeferWeightGrads, so its linears split their backward again)
        return create_selective_checkpoint_contexts(_selective) if how == "selective" else noop_context_fn()
    block.forward = lambda h, cos, sin: recompute(inner, h, cos, sin, use_reentrant=False, context_fn=contexts)


def _pipeline_units(stage):
    """In a pipeline every module with parameters is a ZeRO unit (blocks, embedding, positions, norms, head; a tied
    matrix, in two of them, joins the root unit)."""
    return list(stage.layers.values()) + [m for m in (getattr(stage, n, None) for n in (
        "tok_embeddings", "pos_embeddings", "embed_norm", "norm", "output")) if m is not None]


# ---- the command line ------------------------------------------------------------------------------------

def parse_args(argv=None):
    """The command line, grouped by the lesson each flag belongs to."""
    p = argparse.ArgumentParser(description="Capstone: every strategy composed by mesh sizes, with the same "
                                            "losses as one process on every layout.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mesh = p.add_argument_group("the mesh (lesson 0): sizes multiply to the world; ep borrows data-parallel ranks")
    for dim in ("pp", "dp-replicate", "dp-shard", "cp", "tp", "ep"):
        mesh.add_argument(f"--{dim}", type=int, default=1)
    dp = p.add_argument_group("data parallel, ZeRO, HSDP (lessons 1-3)")
    dp.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                    help="how the data-parallel ranks shard (default: 3 when dp-shard > 1, else 0)")
    dp.add_argument("--bucket-mb", type=float, default=25,
                    help="ZeRO stage 0: data parallel's bucket size in MiB (ddp.BucketedDDP; its first bucket 1 MiB)")
    dp.add_argument("--offload", action="store_true",
                    help="ZeRO-Offload: fp32 master weights and optimizer state in host memory, the optimizer "
                         "steps there")
    tp = p.add_argument_group("tensor parallel (lesson 4)")
    tp.add_argument("--sequence-parallel", action="store_true",
                    help="with --tp: norms and residuals on S/tp tokens (all-gather/reduce-scatter for all-reduce)")
    pp = p.add_argument_group("pipeline parallel (lesson 5)")
    pp.add_argument("--schedule", choices=sorted(pipeline.SCHEDULES), default="1f1b")
    pp.add_argument("--virtual-stages", type=int, default=1,
                    help="model chunks per pipeline rank (--schedule interleaved)")
    pp.add_argument("--microbatches", type=int, default=None,
                    help="micro-batches per step (default: pp; without pp they accumulate gradients)")
    cp = p.add_argument_group("context parallel (lesson 6)")
    cp.add_argument("--cp-method", choices=["ring", "ulysses"], default="ring",
                    help="context parallel by passing k/v blocks around a ring, or by all-to-all to head shards")
    cp.add_argument("--cp-ulysses", type=int, default=None,
                    help="with --cp-method ulysses: Ulysses over this many of the cp ranks, a ring over the rest "
                         "(default: all cp ranks, no ring)")
    ep = p.add_argument_group("experts (lesson 7)")
    ep.add_argument("--experts", type=int, default=0, help="0: dense MLP")
    ep.add_argument("--top-k", type=int, default=2)
    run = p.add_argument_group("the model, the data and the optimizer")
    run.add_argument("--model", choices=sorted(CONFIGS), default="tiny",
                     help="the model's shape (--init-from a Hugging Face directory: its config.json's instead)")
    run.add_argument("--layers", type=int, default=None, help="override the model's number of layers")
    run.add_argument("--global-batch-size", type=int, default=8, help="sequences per optimizer step")
    for name, default in [("seq-len", 32), ("steps", 10), ("warmup", 2), ("seed", 0)]:
        run.add_argument(f"--{name}", type=int, default=default)
    run.add_argument("--pad-share", type=float, default=0.0,
                     help="pad up to this share of each sequence (its targets count nowhere): uneven tokens per rank")
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    run.add_argument("--data", default=None, help="a text file (default: the built-in corpus)")
    fast = p.add_argument_group("memory and speed")
    fast.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                      help="bfloat16: bf16 compute, fp32 master weights, optimizer and gradient reduction")
    fast.add_argument("--activation-checkpointing", choices=["none", "selective", "full"], default="none",
                      help="keep every activation; keep only what SAVED_BY_SELECTIVE's ops make (recompute the "
                           "rest); or keep only each block's input (recompute its whole forward in backward)")
    fast.add_argument("--compile", action="store_true",
                      help="torch.compile each block before anything wraps or shards it (its collectives break the "
                           "graph)")
    fast.add_argument("--compile-backend", default="inductor",
                      help="with --compile: inductor (fused kernels) or aot_eager, ...")
    fast.add_argument("--float8", action="store_true",
                      help="the linear layers' matmuls in float8 (e4m3 forward, e5m2 gradients, tensorwise dynamic "
                           "scales; emulated where the device has no float8 matmul); the embedding and head stay")
    ck = p.add_argument_group("checkpoints (lab/checkpoint.py)")
    ck.add_argument("--save", default=None, help="directory to keep checkpoints in (one step_N directory each)")
    ck.add_argument("--save-every", type=int, default=0,
                    help="a checkpoint every N steps (0: only at the end); always at the end")
    ck.add_argument("--keep", type=int, default=0, help="keep the newest K checkpoints under --save (0: all)")
    ck.add_argument("--stop-at", type=int, default=None,
                    help="stop after this step (the schedule still runs to --steps): an interrupted run")
    ck.add_argument("--resume", default=None,
                    help="continue from a checkpoint, on any layout: a step_N directory, a directory of them (its "
                         "newest), or 'auto': the newest under --save, or a fresh start when there is none (one "
                         "command line for the first attempt and every restart)")
    ck.add_argument("--init-from", default=None,
                    help="start from a plain state dict {name: tensor} (--export writes one), or from a Hugging "
                         "Face model directory (config.json gives the model; safetensors weights; its "
                         "tokenizer.json, if any, tokenizes --data)")
    ck.add_argument("--init-read", choices=["every-rank", "rank-0"], default="every-rank",
                    help="--init-from: every rank reads (a whole plain file; only its part of a directory's "
                         "safetensors), or rank 0 reads and sends each rank its part")
    ck.add_argument("--export", default=None,
                    help="afterwards, write the trained model to this file (--export-format torch) or new "
                         "directory (hf)")
    ck.add_argument("--export-format", choices=["torch", "hf"], default="torch",
                    help="--export: one plain state dict, or a Hugging Face directory (config.json, safetensors) "
                         "that transformers' from_pretrained loads")
    ck.add_argument("--fail-at", type=int, default=None,
                    help="simulate a crash: the last rank dies right after this step, on torchrun's first attempt "
                         "only")
    out = p.add_argument_group("what the run reports (lab/train_demo.py) and plans (lab/plan.py)")
    out.add_argument("--check", action="store_true",
                     help="afterwards, train the same model in ONE process on rank 0 and compare the losses (and "
                          "gradient norms); if they differ, replay the run to say where it first differs")
    out.add_argument("--check-tolerance", type=float, default=None,
                     help="with --check: the largest loss difference (and relative norm difference) taken as equal "
                          "(default: the dtype's, lab/baseline.py's LOSS_TOL)")
    out.add_argument("--lesson", action="append", default=[], metavar="NAME=FILE",
                     help="run with FILE (e.g. yours/tensor_parallel.py, or an edited copy) in place of the lesson "
                          "NAME (lab/changed_lesson.py); repeatable")
    out.add_argument("--compare", action="store_true",
                     help="afterwards, run the same layout with PyTorch's FSDP2 + DTensor TP and compare")
    collective_watch.add_flags(out)   # --watch, --patience
    out.add_argument("--log-file", default=None, help="append one JSON object per step")
    out.add_argument("--quiet", action="store_true", help="no per-step lines")
    out.add_argument("--track-memory", action="store_true",
                     help="measure each step's peak as the bytes of live tensors (PyTorch's MemTracker), on CPU "
                          "too, where the default is the process's resident size")
    out.add_argument("--plan", action="store_true",
                     help="print what each rank would hold (by category, beside the formulas) and exit: no "
                          "training, no memory, no processes — the sizes multiply to the world it plans for")
    out.add_argument("--device-memory", default=None, help="with --plan: say whether it fits, e.g. 80GB or 24GiB")
    out.add_argument("--device", default=None,
                     help="with --plan: predict the step time, tokens/s and MFU on this device (lab/devices.py's "
                          "DEVICES: h100, h100-gt, h200, a100, a100-jz, cpu-gloo)")
    out.add_argument("--search", action="store_true",
                     help="with --plan and --device: every layout for --gpus ranks, those that do not fit dropped "
                          "with why, the rest ranked by predicted step time (the model and batch flags as given)")
    out.add_argument("--gpus", type=int, default=None, help="with --search: the number of ranks to plan for")
    out.add_argument("--gpus-per-node", type=int, default=None,
                     help="with --device: ranks per node (default: the device's); groups beyond it cross nodes")
    out.add_argument("--assume", action="append", default=[], metavar="KEY=VALUE",
                     help="with --device: replace one of the time model's assumptions (lab/plan_time.py's "
                          "Assumptions), e.g. efficiency=0.3, inter_beta=12.5e9, overlap.tp=0.5; repeatable")
    args = p.parse_args(argv)
    if args.zero_stage is None:
        args.zero_stage = 3 if args.dp_shard > 1 else 0
    if args.microbatches is None:
        args.microbatches = args.pp
    if args.cp_ulysses is None:
        args.cp_ulysses = args.cp if args.cp_method == "ulysses" else 1
    return args


def store_dtype(args) -> torch.dtype:
    """The dtype parameters are stored in (bf16 runs compute in bf16 from fp32 master weights)."""
    return torch.float64 if args.dtype == "float64" else torch.float32


def config_of(args):
    """The model's shape: --init-from a Hugging Face directory's config.json, else --model (--layers, --experts)."""
    if checkpoint.is_hf_directory(args.init_from):
        return hf.read_config(args.init_from)
    layers = {} if args.layers is None else dict(n_layers=args.layers)
    return get_config(args.model, n_experts=args.experts, top_k=args.top_k, **layers)


def model_name(args) -> str:
    """What the run trains: --model's name, or the Hugging Face directory whose config.json gave the shape."""
    return f"{args.init_from} (config.json)" if checkpoint.is_hf_directory(args.init_from) else args.model


def layout_of(args) -> dict:
    """The layout a run trains on (a checkpoint records it; another layout may load it)."""
    return {**{k: getattr(args, k) for k in DIMS + ("ep", "zero_stage", "layers", "experts", "top_k", "dtype",
                                                     "sequence_parallel", "virtual_stages")}, "model": model_name(args)}


def model_shapes(args, tied_twice: bool = False) -> dict:
    """{name: shape} of every parameter of the whole model, the names of lab/model.py's unsharded model
    (from the meta device: no memory); tied_twice: a tied matrix under both its names, as a state dict holds it."""
    model = build_model(config_of(args), device="meta")
    return {n: list(p.shape) for n, p in model.named_parameters(remove_duplicate=not tied_twice)}


def resume_path(args) -> str | None:
    """The checkpoint --resume names (None: a fresh start): lab.checkpoint.resume_path."""
    return checkpoint.resume_path(args.resume, args.save)


def _divisors(n: int, limit: int = 64) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def check_args(args, world_size: int) -> None:
    """Every invalid combination, found from the arguments alone — so every rank finds the same problems
    before any collective. Each lesson's own check judges its dimension; what only the composition can
    get wrong is checked here. Raises one ValueError listing what is wrong and what is valid."""
    dims = {d: getattr(args, d) for d in DIMS}
    counts = dict(dims, ep=args.ep, microbatches=args.microbatches, global_batch_size=args.global_batch_size,
                  seq_len=args.seq_len, steps=args.steps, virtual_stages=args.virtual_stages,
                  cp_ulysses=args.cp_ulysses, layers=args.layers or 1)
    small = [f"--{k.replace('_', '-')} {v}" for k, v in counts.items() if v < 1]
    if small:
        raise ValueError("invalid training layout:\n  - " + ", ".join(small) + " must be >= 1")
    problems = mesh_problems(dims, world_size, args.ep)  # the sizes multiply to the world, ep divides dp
    try:
        cfg = config_of(args)
    except ValueError as e:
        raise ValueError(f"invalid training layout:\n  - {e}") from None
    tp, cp, pp, m, u = args.tp, args.cp, args.pp, args.microbatches, args.cp_ulysses
    dp = args.dp_replicate * args.dp_shard

    def lesson(check, *check_args, prefix="", hint=""):  # a lesson's own check: its message, and the flag
        try:
            check(*check_args)
        except ValueError as e:
            problems.append(f"{prefix}{e}{hint}")

    lesson(tensor_parallel.check_divisible, cfg, tp, hint=" (--tp)")
    if args.global_batch_size % (dp * m):
        problems.append(f"--global-batch-size {args.global_batch_size} is not divisible by the data-parallel size "
                        f"{dp} times --microbatches {m}: use a multiple of {dp * m}")
    if pp > 1 or args.virtual_stages > 1:  # schedule, micro-batches, layers per stage (the batch: just above)
        lesson(pipeline.validate, pp, m, cfg.n_layers, m, args.schedule, args.virtual_stages, prefix="pipeline: ")
    if cp > 1:
        lesson(ring_attention.check_layout, args.seq_len, cp, CP_LAYOUT, hint=" (--seq-len)")
    if u > 1 and (args.cp_method != "ulysses" or cp % u):
        problems.append(f"--cp-ulysses {u} needs --cp-method ulysses and must divide --cp {cp}: "
                        f"choose from {_divisors(cp)}")
    elif u > 1:  # Ulysses splits each tp rank's query heads over u cp ranks
        heads = cfg.n_heads // tp
        lesson(ring_attention.check_ulysses, heads, u,
               hint=f" (train.py's Ulysses splits each tp rank's {heads} query heads over {u} ranks: choose "
                    f"--cp-ulysses from {[d for d in _divisors(cp) if heads % d == 0]}, or --cp-method ring)")
    if args.seq_len > cfg.max_seq_len:
        problems.append(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    if args.sequence_parallel and tp > 1 and (args.seq_len // cp) % tp:
        problems.append(f"--sequence-parallel splits each rank's {args.seq_len // cp} tokens over tp={tp}: "
                        f"use a --seq-len that is a multiple of {tp * cp * (2 if cp > 1 else 1)}")
    if cp > 1 and cfg.positions == "alibi":
        problems.append("--cp with ALiBi positions: ALiBi adds m·(j − i) to each score, which needs every block's "
                        "query and key offsets, and ring attention and Ulysses here compute plain causal attention "
                        "without it: train an ALiBi model without --cp (every other dimension works)")
    if args.ep > 1 and not cfg.n_experts:
        problems.append("--ep > 1 needs a mixture-of-experts model: give --experts E")
    if cfg.n_experts:
        lesson(expert_parallel.validate_ep, cfg.n_experts, cfg.top_k, args.ep)
    if args.zero_stage > 0 and dp * cp == 1:
        problems.append(f"--zero-stage {args.zero_stage} shards over data-parallel (and cp) ranks, but there "
                        f"is only one: use --zero-stage 0 or --dp-shard > 1")
    if not 0.0 <= args.pad_share < 1.0:
        problems.append(f"--pad-share {args.pad_share} must be in [0, 1)")
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        problems.append(f"--stop-at {args.stop_at} must be between 1 and --steps {args.steps}")
    tokenizer = None
    if checkpoint.is_hf_directory(args.init_from):  # config.json gives the shape; the files must hold it
        given = [f for f, v in (("--layers", args.layers), ("--experts", args.experts)) if v]
        if given:
            problems.append(f"{' and '.join(given)}: --init-from {args.init_from!r} is a Hugging Face directory, "
                            f"whose config.json gives the model's shape: leave them out")
        hf_problems = checkpoint.hf_problems(args.init_from, weights=not args.plan)  # a plan: config.json alone
        problems += hf_problems
        tokenizer = None if hf_problems else checkpoint.tokenizer_of(args.init_from)
    if args.data is not None and not os.path.isfile(args.data):
        problems.append(f"--data {args.data!r} does not exist: give an existing text file or leave it out")
    elif args.data is not None:  # tokens: bytes, or what the model's tokenizer makes of the text
        n = len(load_corpus(args.data, tokenizer=tokenizer)) if tokenizer else os.path.getsize(args.data)
        if n < args.seq_len + 1:
            what = f"tokens of {checkpoint.TOKENIZER}" if tokenizer else "bytes (byte tokens)"
            longer = "a longer text" if tokenizer else f"a text of at least {args.seq_len + 1} bytes"
            problems.append(f"--data {args.data!r} holds {n} {what}, fewer than --seq-len + 1 = {args.seq_len + 1}: "
                            f"give {longer} or a shorter --seq-len")
    for flag in ("save_every", "keep"):
        if getattr(args, flag) < 0:
            problems.append(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 0")
    if args.resume == "auto" and not args.save:
        problems.append("--resume auto continues from the newest checkpoint under --save: give --save DIR too")
    resume = resume_path(args)
    if resume is not None:
        problems += checkpoint.checkpoint_problems(resume, args.stop_at or args.steps, model_shapes(args))
    elif args.resume not in (None, "auto"):
        problems.append(f"--resume {args.resume!r} holds no complete checkpoint (a step_N directory with "
                        f"meta.json): give one, or a directory of them, or --resume auto")
    if args.init_from is not None and resume is None and not checkpoint.is_hf_directory(args.init_from):
        problems += checkpoint.state_dict_problems(args.init_from, model_shapes(args, tied_twice=True))
    if args.export is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.export))):
        problems.append(f"--export {args.export!r}: its directory does not exist")
    elif args.export is not None and args.export_format == "hf" and os.path.exists(args.export):
        problems.append(f"--export {args.export!r} --export-format hf writes a new directory, and this one exists: "
                        f"give a new path (an export never writes over a directory)")
    if args.export is not None and args.export_format == "hf":
        lesson(hf.family, cfg, prefix="--export-format hf: ", hint=" (--export-format torch writes any model)")
    gpt = (cfg.norm, cfg.mlp, cfg.positions, cfg.bias, cfg.tie_embeddings, cfg.embed_norm, cfg.padded_vocab) != \
        ("rms", "swiglu", "rope", False, False, False, cfg.vocab_size)   # (torchtitan's tp plan is Llama's)
    if args.compare and (pp > 1 or cp > 1 or cfg.n_experts or dp > 1 and args.zero_stage != 3 or args.pad_share or gpt):
        problems.append("--compare runs PyTorch's FSDP2 (ZeRO-3) + DTensor tensor parallel: use only "
                        "--dp-replicate, --dp-shard (zero stage 3) and --tp, on a dense Llama-shaped model (none of "
                        "lab/model.py's GPT-family options) without padding")
    problems += plan_problems(args)
    if problems:
        raise ValueError("invalid training layout:\n  - " + "\n  - ".join(problems))


def plan_problems(args) -> list[str]:
    """--device, --search, --gpus, --gpus-per-node, --assume: only with --plan, and with what they need (the
    device's name: lab.plan_time.device_named, which lists the known ones; --assume's keys:
    lab.plan_time.assumptions, which lists them — lab/ imports train, not the other way)."""
    out = []
    device, search = getattr(args, "device", None), getattr(args, "search", False)
    if (device or search) and not args.plan:
        out.append("--device and --search plan a run: give --plan too")
    if search and (device is None or not getattr(args, "gpus", None)):
        out.append("--search needs --device NAME and --gpus N (and --gpus-per-node G, default the device's)")
    for flag in ("gpus", "gpus_per_node"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            out.append(f"--{flag.replace('_', '-')} must be >= 1")
    assume = getattr(args, "assume", None) or []
    if assume and not device:
        out.append("--assume changes the time model: give --plan --device NAME too")
    out += [f"--assume {a!r}: give KEY=VALUE (the keys: lab.plan_time.Assumptions' fields, e.g. efficiency=0.3)"
            for a in assume if "=" not in a]
    return out


def lr_at(step: int, args) -> float:
    """Linear warm-up to --lr over --warmup steps, then cosine decay to 10% at --steps (step from 1)."""
    if step <= args.warmup:
        return args.lr * step / max(1, args.warmup)
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


if __name__ == "__main__":  # measured, printed, --check and --compare: the capstone's runner in the package
    from lab.train_demo import main
    main()
