"""Every layout is built on the meta device: a rank materialises only what it keeps (issue 29, point 4).

train.Trainer builds the model (or its pipeline stage) with shapes only; tensor, context and expert parallel cut
it on meta; ZeRO (any stage, 0 included) makes each flat unit from this rank's slice of each parameter alone
(fsdp.shard_model's init_fn). The parity tests (test_train.py, test_memory.py) show the losses are unchanged;
here: what a rank holds WHILE building, measured (instruments.BuildPeak: every storage the construction made,
at its size, checked after every op) against the planner's bound for the same layout — what the rank keeps, plus
one unit's flat buffer and one whole parameter for a moment — on every rank. Built whole and then cut, a rank
held its whole model (or stage) first; the planner's `whole` says how much that was, and the test shows the
measured peak below it wherever the rank keeps less than about half of it.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from train import parse_args

COMMON = ["--layers", "8", "--global-batch-size", "8", "--seq-len", "16"]
LAYOUTS = [["--dtype", "float64", "--dp-replicate", "2"], ["--dtype", "float64", "--dp-shard", "2", "--zero-stage", "1"],
           ["--dtype", "float64", "--dp-shard", "2", "--zero-stage", "2"],
           ["--dtype", "float64", "--dp-shard", "2", "--zero-stage", "3"], ["--dtype", "float64", "--tp", "2"],
           ["--dtype", "float64", "--pp", "2"], ["--dtype", "float64", "--cp", "2"],
           ["--dtype", "bfloat16", "--dp-replicate", "2"], ["--dtype", "bfloat16", "--dp-shard", "2", "--zero-stage", "3"],
           ["--dtype", "float32", "--pp", "2", "--tp", "1", "--dp-shard", "1", "--offload"],
           ["--dtype", "float64", "--experts", "4", "--dp-shard", "2", "--ep", "2", "--zero-stage", "1"]]


def build_peaks(layouts, common):
    """Rank function: build train.Trainer for each layout under instruments.BuildPeak; the peak and what is held
    at the end, on this rank, and whether every parameter the model holds is a real (non-meta) tensor."""
    from lab.instruments import BuildPeak
    from mesh import DIMS, Mesh
    from train import Trainer
    out = []
    for flags in layouts:
        args = parse_args([*common, *flags])
        mesh = Mesh(**{d: getattr(args, d) for d in DIMS}, ep=args.ep)
        with BuildPeak() as built:
            trainer = Trainer(args, mesh, torch.device("cpu"))
        real = all(not p.is_meta for u in trainer.opt.units for p in (u.shard, u.master))
        out.append(dict(flags=flags, peak=built.peak, end=built.held(), real=real))
        dist.barrier()
    return out


@pytest.mark.parametrize("world", [2])
def test_every_layout_is_built_on_meta_and_holds_only_what_it_keeps(world):
    from lab.plan import plan_rank
    res = run_ranks(build_peaks, world, LAYOUTS, COMMON, timeout=300)
    below_whole = 0
    for rank, rows in enumerate(res):
        for row in rows:
            flags = row["flags"]
            plan = plan_rank(parse_args(COMMON + flags), rank)["building"]
            assert row["real"], (rank, flags)
            # what it keeps: the planner's compute copies + master (+ ddp's buckets), and a few int32 flags
            # per parameter tensor (which parameters got a gradient) that the plan leaves out
            assert 0 <= row["end"] - plan["kept"] <= 4 * 200, (rank, flags, row, plan)
            assert row["peak"] <= plan["peak"], (rank, flags, row, plan)
            if plan["peak"] < plan["whole"]:  # built whole first, the peak would be at least the whole model
                assert row["peak"] < plan["whole"], (rank, flags, row, plan)
                below_whole += 1
    assert below_whole >= 4 * world  # tp, pp, ZeRO-3 (two dtypes) on every rank at least
