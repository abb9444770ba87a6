"""PyTorch's own implementation of the lessons that have one, set up like ours, for side-by-side checks.

Every lesson is written by hand on torch.distributed collectives. PyTorch ships the same ideas as
wrappers; this module builds them on the same model, groups and data, so that a demo's --compare, a
test or a benchmark can put the two side by side: the same numbers, and the step time of each.

    lesson               PyTorch's own                                       here
    ddp.py               torch.nn.parallel.DistributedDataParallel             ddp
    fsdp.py, hsdp.py     FSDP2: torch.distributed.fsdp.fully_shard            fsdp2, hsdp2
    tensor_parallel.py   DTensor: tensor.parallel.parallelize_module          dtensor_tp
    pipeline.py          torch.distributed.pipelining's schedules              torch_pipelining
    expert_parallel.py   functional collectives' all_to_all_single_autograd  all_to_all
    train.py             fully_shard + parallelize_module on a device mesh     train_fsdp2_tp

No strategy imports this module (a strategy never uses a wrapper): each lesson's demo in this package
takes the function it compares with as its `reference`; the tests import it too. mesh.py and
ring_attention.py have no counterpart here: PyTorch's ring attention is experimental.
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist


def ddp(model, group, **kw):
    """PyTorch's DDP over `group` (bucket_cap_mb, device_ids, ... as keywords)."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, process_group=group, **kw)


def fsdp2(model, *, mesh=None, param_dtype=None, reshard_after_forward=True):
    """FSDP2 as fsdp.shard_model cuts the model: each Block a unit, the rest the root. param_dtype:
    compute dtype; gradients are reduced in the parameters' own dtype (fp32 under a bf16 compute copy),
    as ours are. A 2-D mesh (replicate, shard) makes it HSDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=next(model.parameters()).dtype)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def hsdp2(model, replicas: int, shards: int, *, param_dtype=None):
    """FSDP2's HSDP: fsdp2 on a (replicate, shard) device mesh, ranks laid out as in hsdp.py (shard inner)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(model.output.weight.device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    return fsdp2(model, mesh=mesh, param_dtype=param_dtype)


def dtensor_tp(model, group_or_mesh, sp: bool = False):
    """tensor_parallel.py's split with DTensor's parallelize_module (torchtitan's plan): q, k, v, w1, w3
    column-wise, wo and w2 row-wise, the embedding row-wise and the head column-wise; with sp the
    norms on sequence shards [B, S/t, H], gathered once before attention and once before the MLP."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel as Col, PrepareModuleInput as Input
    from torch.distributed.tensor.parallel import RowwiseParallel as Row, SequenceParallel, parallelize_module
    seq, rep = Shard(1) if sp else Replicate(), Replicate()  # the layout between the pairs
    plan = {"tok_embeddings": Row(input_layouts=rep, output_layouts=seq),
            "output": Col(input_layouts=seq, output_layouts=rep), **({"norm": SequenceParallel()} if sp else {})}
    for p in (f"layers.{i}." for i in range(len(model.layers))):
        plan.update({p + n: Col() for n in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")})
        plan.update({p + n: Row(output_layouts=seq) for n in ("attn.wo", "mlp.w2")})
        if sp:
            plan.update({p + "attn_norm": SequenceParallel(), p + "mlp_norm": SequenceParallel(),
                         p + "attn": Input(input_layouts=(seq, None, None), desired_input_layouts=(rep, None, None)),
                         p + "mlp": Input(input_layouts=(seq,), desired_input_layouts=(rep,))})
    mesh = group_or_mesh if not isinstance(group_or_mesh, dist.ProcessGroup) else \
        DeviceMesh.from_group(group_or_mesh, device_type=model.output.weight.device.type)
    return parallelize_module(model, mesh, plan)


def all_to_all(x, out_splits, in_splits, group):
    """PyTorch's differentiable all-to-all, with expert_parallel.AllToAll's signature."""
    import torch.distributed._functional_collectives as funcol
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, out_splits, in_splits, group))


PIPELINING = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
              "zb": "ScheduleInterleavedZeroBubble"}  # PyTorch's zero-bubble for one stage per rank: ZB-H1's order


def torch_pipelining(out, cfg, name, m, batch, device, group) -> bool:
    """pipeline.py's split run by torch.distributed.pipelining's schedule of the same name, from the same
    initial weights: gradients and step time side by side. Shapes are given up front, as ours are.
    out: what lab.pipeline_demo.train returned on this rank (its PipeGroup, Stage and actions)."""
    import torch.distributed.pipelining as pl

    from lab.baseline import max_diff, snapshot
    from lab.instruments import time_side_by_side
    from lab.model import CrossEntropy
    from lab.report import all_agree, print0
    from pipeline import Stage, pipeline_step
    (x, y), pipe, v = (t.to(device) for t in batch), out["pipe"], out["stage"].v
    p, b, n = pipe.p, x.shape[0] // m, pipe.p * v
    if name == "1f1b" and m < p:  # the schedule allows it, PyTorch's implementation does not
        print0(f"  torch.distributed.pipelining {PIPELINING[name]} needs m >= p: nothing to compare with")
        return True
    ours, chunks = Stage(cfg, pipe.r, p, 0, device, v=v), [Stage(cfg, c * p + pipe.r, n, 0, device) for c in range(v)]
    act = torch.empty(b, x.shape[1], cfg.dim, device=device, requires_grad=True)  # a boundary's [b, S, H]
    logits = torch.empty(b, x.shape[1], cfg.vocab_size, device=device)
    stages = [pl.PipelineStage(ch, s, n, device, group=group, input_args=(x[:b],) if s == 0 else (act,),
                               output_args=(logits,) if s == n - 1 else (act,))
              for s, ch in ((c * p + pipe.r, ch) for c, ch in enumerate(chunks))]
    sched = getattr(pl, PIPELINING[name])(stages if name in ("interleaved", "zb") else stages[0], m,
                                          loss_fn=CrossEntropy())
    steps = dict(ours=lambda: pipeline_step(ours, out["actions"], pipe, x, y, m),  # every rank passes the loss
                 theirs=lambda: sched.step(*((x,) if pipe.r == 0 else ()), target=y if pipe.r == p - 1 else None))
    for f in steps.values():  # one step each: the gradients must agree
        f()
    diff = max_diff(snapshot(ours, grads=True), {k: q.grad for ch in chunks for k, q in ch.named_parameters()})
    t = time_side_by_side(steps, group=group, device=device)  # alternating rounds, median each
    t = torch.tensor([diff, t["ours"], t["theirs"]])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    print0(f"  torch.distributed.pipelining {PIPELINING[name]}: gradients max |diff| {t[0]:.1e}; step time "
           f"ours {t[1] * 1e3:.1f} ms, theirs {t[2] * 1e3:.1f} ms: ours/theirs {t[1] / t[2]:.2f}")
    return all_agree(t[0].item() < 1e-6)


def _fsdp2_tp_model(args, device):
    """train.py's model on its layout (dp_replicate x dp_shard x tp) under fully_shard + parallelize_module."""
    from torch.distributed.device_mesh import init_device_mesh

    from lab.model import build_model
    from train import config_of, store_dtype
    shape = (args.dp_replicate, args.dp_shard, args.tp)  # the same row-major order as mesh.py
    dm = init_device_mesh(device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    model = build_model(config_of(args), seed=args.seed, device=device, dtype=store_dtype(args))
    if args.tp > 1:
        dtensor_tp(model, dm["tp"])
    if args.dp_replicate * args.dp_shard > 1:
        fsdp2(model, mesh=dm["dp_replicate", "dp_shard"] if args.dp_replicate > 1 else dm["dp_shard"])
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def train_fsdp2_tp(args, device):
    """train.py's layout (dp_replicate x dp_shard x tp, no pp/cp/ep) under fully_shard + parallelize_module:
    the same model, batches, AdamW, learning-rate schedule and clipping. Returns (losses, seconds per step)."""
    from lab.data import get_batch, load_corpus
    from train import lr_at
    model, opt = _fsdp2_tp_model(args, device)
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
            sq, world = torch.zeros((), dtype=torch.float64, device=device), dist.get_world_size()
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
    return losses, statistics.median(times[1:] or times)


def dcp_checkpoint(args, device, directory):
    """torch.distributed.checkpoint saving and loading what train.py's checkpoint holds — the model and its
    AdamW state — of the same model on the same layout under FSDP2 (+ DTensor TP), after one step.
    Returns (save(), load(), bytes this rank's files hold after a save): the functions to time."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lab.data import get_batch, load_corpus
    model, opt = _fsdp2_tp_model(args, device)
    dp, dp_rank = args.dp_replicate * args.dp_shard, dist.get_rank() // args.tp
    model(*get_batch(load_corpus(args.data), 0, args.global_batch_size, args.seq_len, args.seed, dp_rank, dp,
                     device=device)).backward()
    opt.step()  # the AdamW state exists, as in a checkpoint of ours

    saves = []  # a new directory per save (DCP warns when it overwrites one)

    def save():
        saves.append(os.path.join(directory, str(len(saves))))
        msd, osd = get_state_dict(model, opt)
        dcp.save(dict(model=msd, optim=osd), checkpoint_id=saves[-1])

    def load():
        msd, osd = get_state_dict(model, opt)
        state = dict(model=msd, optim=osd)
        dcp.load(state, checkpoint_id=saves[-1])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def written() -> int:  # this rank's data files in the last save (DCP names them __<rank>_<n>.distcp)
        return sum(os.path.getsize(os.path.join(saves[-1], f)) for f in os.listdir(saves[-1])
                   if f.startswith(f"__{dist.get_rank()}_"))
    return save, load, written
