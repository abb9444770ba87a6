"""The capstone's command line (train.py): every flag, and every invalid combination found from the
arguments alone, so every rank refuses the same layout with the same message before any collective
(and nothing hangs). Each message names the fix: the valid sizes, or the flag to change.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import expert_parallel
import pipeline
from mesh import DIMS, mesh_problems
from model import CONFIGS, get_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
CP_LAYOUT = "zigzag"  # how context parallel splits a sequence (ring_attention.py): balanced causal work


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Capstone: every strategy composed by mesh sizes, with the same "
                                            "losses as one process on every layout.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    arg = p.add_argument
    for dim in ("pp", "dp-replicate", "dp-shard", "cp", "tp", "ep"):
        arg(f"--{dim}", type=int, default=1)
    arg("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
        help="how the data-parallel ranks shard (default: 3 when dp-shard > 1, else 0)")
    arg("--sequence-parallel", action="store_true",
        help="with --tp: norms and residuals on S/tp tokens (all-gather/reduce-scatter for all-reduce)")
    arg("--cp-method", choices=["ring", "ulysses"], default="ring",
        help="context parallel by passing k/v blocks around a ring, or by all-to-all to head shards")
    arg("--cp-ulysses", type=int, default=None,
        help="with --cp-method ulysses: Ulysses over this many of the cp ranks, a ring over the rest "
             "(default: all cp ranks, no ring)")
    arg("--schedule", choices=sorted(pipeline.SCHEDULES), default="1f1b")
    arg("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank (--schedule interleaved)")
    arg("--microbatches", type=int, default=None,
        help="micro-batches per step (default: pp; without pp they accumulate gradients)")
    arg("--model", choices=sorted(CONFIGS), default="tiny")
    arg("--layers", type=int, default=None, help="override the model's number of layers")
    arg("--experts", type=int, default=0, help="0: dense MLP")
    arg("--top-k", type=int, default=2)
    arg("--global-batch-size", type=int, default=8, help="sequences per optimizer step")
    for name, default in [("seq-len", 32), ("steps", 10), ("warmup", 2), ("seed", 0)]:
        arg(f"--{name}", type=int, default=default)
    arg("--pad-share", type=float, default=0.0,
        help="pad up to this share of each sequence (its targets count nowhere): uneven tokens per rank")
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
    layers = {} if args.layers is None else dict(n_layers=args.layers)
    return get_config(args.model, n_experts=args.experts, top_k=args.top_k, **layers)


def layout_of(args) -> dict:
    """What a checkpoint must agree on to be resumed."""
    return {k: getattr(args, k) for k in DIMS + ("ep", "zero_stage", "model", "layers", "experts", "top_k", "dtype",
                                                  "sequence_parallel", "virtual_stages")}


def _divisors(n: int, limit: int = 64) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def check_args(args, world_size: int) -> None:
    """Every invalid combination, found from the arguments alone — so every rank finds the same
    problems before any collective. Raises one ValueError listing what is wrong and what is valid."""
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
    tp, cp, pp, m = args.tp, args.cp, args.pp, args.microbatches
    dp = args.dp_replicate * args.dp_shard
    sizes = [("n_heads", cfg.n_heads), ("vocab_size", cfg.vocab_size)] + ([] if cfg.n_experts else [("ffn_dim", cfg.ffn_dim)])
    for name, size in sizes:
        if size % tp:
            problems.append(f"--tp {tp} does not divide the model's {name} ({size}): choose tp from {_divisors(size, 16)}")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        problems.append(f"--tp {tp} and n_kv_heads {cfg.n_kv_heads}: one must divide the other")
    if args.global_batch_size % (dp * m):
        problems.append(f"--global-batch-size {args.global_batch_size} is not divisible by the data-parallel size "
                        f"{dp} times --microbatches {m}: use a multiple of {dp * m}")
    if pp > 1 or args.virtual_stages > 1:
        try:  # the pipeline's own check (pure arithmetic): schedule, micro-batches, layers per stage
            pipeline.validate(pp, m, cfg.n_layers, m, args.schedule, args.virtual_stages)  # (batch: checked above)
        except ValueError as e:
            problems.append(f"pipeline: {e}")
    if cp > 1 and args.seq_len % (2 * cp):
        problems.append(f"--seq-len {args.seq_len} is not divisible by 2*cp = {2 * cp} "
                        f"({CP_LAYOUT} layout): use a multiple of {2 * cp}")
    u = args.cp_ulysses
    if u > 1 and (args.cp_method != "ulysses" or cp % u):
        problems.append(f"--cp-ulysses {u} needs --cp-method ulysses and must divide --cp {cp}: "
                        f"choose from {_divisors(cp)}")
    elif u > 1 and (cfg.n_heads // tp) % u:
        problems.append(f"Ulysses splits each tp rank's {cfg.n_heads // tp} query heads over {u} ranks: choose "
                        f"--cp-ulysses from {[d for d in _divisors(cp) if (cfg.n_heads // tp) % d == 0]} "
                        f"(or --cp-method ring)")
    if args.seq_len > cfg.max_seq_len:
        problems.append(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    if args.sequence_parallel and tp > 1 and (args.seq_len // cp) % tp:
        problems.append(f"--sequence-parallel splits each rank's {args.seq_len // cp} tokens over tp={tp}: "
                        f"use a --seq-len that is a multiple of {tp * cp * (2 if cp > 1 else 1)}")
    if args.ep > 1 and not args.experts:
        problems.append("--ep > 1 needs a mixture-of-experts model: give --experts E")
    if args.experts:
        try:
            expert_parallel.validate_ep(args.experts, args.top_k, args.ep)
        except ValueError as e:
            problems.append(str(e))
    if args.zero_stage > 0 and dp * cp == 1:
        problems.append(f"--zero-stage {args.zero_stage} shards over data-parallel (and cp) ranks, but there "
                        f"is only one: use --zero-stage 0 or --dp-shard > 1")
    if not 0.0 <= args.pad_share < 1.0:
        problems.append(f"--pad-share {args.pad_share} must be in [0, 1)")
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        problems.append(f"--stop-at {args.stop_at} must be between 1 and --steps {args.steps}")
    if args.data is not None and not os.path.isfile(args.data):
        problems.append(f"--data {args.data!r} does not exist: give an existing text file or leave it out")
    elif args.data is not None and os.path.getsize(args.data) < args.seq_len + 1:
        problems.append(f"--data {args.data!r} holds {os.path.getsize(args.data)} bytes (byte tokens), fewer than "
                        f"--seq-len + 1 = {args.seq_len + 1}: give a text of at least {args.seq_len + 1} bytes "
                        f"or a shorter --seq-len")
    if args.resume is not None:
        problems += _resume_problems(args, world_size)
    if args.compare and (pp > 1 or cp > 1 or args.experts or dp > 1 and args.zero_stage != 3 or args.pad_share):
        problems.append("--compare runs PyTorch's FSDP2 (ZeRO-3) + DTensor tensor parallel: use only "
                        "--dp-replicate, --dp-shard (zero stage 3) and --tp, on a dense model without padding")
    if problems:
        raise ValueError("invalid training layout:\n  - " + "\n  - ".join(problems))


def _resume_problems(args, world_size) -> list[str]:
    meta = os.path.join(args.resume, "meta.json")
    if not os.path.isfile(meta):
        return [f"--resume {args.resume!r} holds no checkpoint (meta.json missing)"]
    with open(meta) as f:
        saved = json.load(f)
    problems, last = [], args.stop_at or args.steps
    if saved["step"] >= last:
        problems.append(f"--resume {args.resume!r} already holds step {saved['step']}, and this run stops at step "
                        f"{last}: nothing is left to train; raise --steps or resume an earlier checkpoint")
    if saved["layout"] != layout_of(args):
        problems.append(f"--resume {args.resume!r} was written with {saved['layout']}; resume with the same "
                        f"sizes, stage, model and dtype (got {layout_of(args)})")
    missing = [r for r in range(world_size) if not os.path.isfile(os.path.join(args.resume, f"rank{r}.pt"))]
    if missing:  # found here, by every rank alike: not by one rank while the others wait
        problems.append(f"--resume {args.resume!r} lacks the shards of ranks {missing}")
    return problems
