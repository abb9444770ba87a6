"""Memory (issue 24): activation checkpointing (none, selective, full) composed with every mesh dimension and
equal to one process; the activation bytes a block keeps measured against lab.plan.activation_formula."""
import pytest
import torch

from harness import run_ranks
from lab.train_demo import activation_profile, reference_losses, run_layouts
from train import parse_args

COMMON = ["--dtype", "float64", "--steps", "4", "--global-batch-size", "8", "--seq-len", "16", "--lr", "3e-3",
          "--grad-clip", "1.7"]
DIMENSIONS = [["--dp-shard", "2", "--zero-stage", "3"], ["--dp-shard", "2", "--zero-stage", "0"],
              ["--dp-replicate", "2"], ["--tp", "2"], ["--tp", "2", "--sequence-parallel"], ["--cp", "2"],
              ["--cp", "2", "--cp-method", "ulysses"], ["--pp", "2", "--microbatches", "2"],
              ["--pp", "2", "--schedule", "zb", "--microbatches", "2"],
              ["--experts", "4", "--dp-shard", "2", "--ep", "2"]]


def test_selective_and_full_checkpointing_equal_one_process_on_every_dimension():
    """Each dimension alone on 2 ranks (ZeRO-3's gather hooks, tp and sp, ring and Ulysses, a pipeline and zero
    bubble's split backward, which the recompute splits again, experts), with selective and full checkpointing."""
    layouts = [lay + ["--activation-checkpointing", how] for how in ("selective", "full") for lay in DIMENSIONS]
    res = run_ranks(run_layouts, 2, layouts, COMMON, timeout=600)
    for i, flags in enumerate(lay["flags"] for lay in res[0]):
        want = reference_losses(parse_args(COMMON + flags.split()))
        for rank, lays in enumerate(res):  # every rank reports the global losses
            err = max(abs(a - b) for a, b in zip(lays[i]["losses"], want))
            assert err < 1e-9, (rank, flags, err)


@pytest.mark.parametrize("world, dtype, sp", [(1, torch.float32, False), (1, torch.bfloat16, False),
                                              (1, torch.float64, False), (2, torch.float32, False),
                                              (2, torch.bfloat16, True), (4, torch.float32, True)])
def test_activation_bytes_equal_the_formula(world, dtype, sp):
    """What one block keeps for its backward, per token, for none / selective / full, measured from what autograd
    and checkpointing save (instruments.SavedBytes; never a tensor only a collective's thread still holds) —
    equal to activation_formula to the byte, with tp = world."""
    for rank, res in enumerate(run_ranks(activation_profile, world, dtype=dtype, sp=sp, repeats=1, timeout=120)):
        for how, r in res.items():
            assert r["bytes_per_token"] == r["formula"], (rank, how, r)
        none, selective, full = (res[h]["bytes_per_token"] for h in ("none", "selective", "full"))
        assert none > selective > full == 0, rank


def _gpt_family_profiles():
    return {m: activation_profile(m, hows=("none", "selective"), dtype=torch.bfloat16, sp=True, repeats=1)
            for m in ("tiny-gpt2", "tiny-bloom")}


def test_gpt_family_activation_bytes_equal_the_formula():
    """The GPT-family options in the same count, under tp 2 in bf16 with sequence parallel: LayerNorm keeps its
    fp32 input, mean and 1/std, GPT's GELU MLP two F-wide tensors (one under selective), biases and learned
    positions nothing more, ALiBi's 4-D bias (one tensor every layer shares) lets SDPA take its fused kernel —
    measured equal to activation_formula, to the byte."""
    for rank, res in enumerate(run_ranks(_gpt_family_profiles, 2, timeout=120)):
        for case, profile in res.items():
            for how, r in profile.items():
                assert r["bytes_per_token"] == r["formula"], (rank, case, how, r)


OFFLOAD = [["--dp-shard", "2", "--zero-stage", str(z)] for z in range(4)] + [
    ["--tp", "2"], ["--pp", "2", "--microbatches", "2"], ["--experts", "4", "--dp-shard", "2", "--ep", "2"],
    ["--dp-shard", "2", "--activation-checkpointing", "selective"]]


def test_offload_equals_one_process_and_moves_what_the_formula_says():
    """--offload (the fp32 master and AdamW state in host memory, the optimizer stepping there) on every ZeRO
    stage and with tp, pp and experts: equal to one process; per step each rank moves exactly each reduced
    gradient slice down (b_m·n) and each new compute slice up (b_p·n), counted by wrapping OffloadedUnit's
    download and upload from outside. In bf16 the way up carries half the bytes."""
    res = run_ranks(run_layouts, 2, [lay + ["--offload"] for lay in OFFLOAD], COMMON, timeout=600)
    for i, flags in enumerate(lay["flags"] for lay in res[0]):
        want = reference_losses(parse_args(COMMON + flags.split()))
        for rank, lays in enumerate(res):  # every rank: the global losses, and its own slices moved
            lay = lays[i]
            assert max(abs(a - b) for a, b in zip(lay["losses"], want)) < 1e-9, (rank, flags)
            assert lay["offload_bytes"] == [lay["offload_formula"]] * len(lay["losses"]), (rank, flags)
            assert lay["offload_formula"][0] > 0, (rank, flags)
    for bf16, in run_ranks(run_layouts, 2, [["--dp-shard", "2", "--offload", "--dtype", "bfloat16"]], ["--steps", "2"],
                           timeout=120):
        down, up = bf16["offload_formula"]
        assert bf16["offload_bytes"] == [(down, up)] * 2 and down == 2 * up


PLANNED = {2: [["--dp-shard", "2", "--zero-stage", str(z)] for z in range(4)] + [
               ["--tp", "2"], ["--pp", "2"], ["--dp-shard", "2", "--dtype", "bfloat16"],
               ["--dp-shard", "2", "--offload", "--dtype", "bfloat16"]],
           4: [["--dp-replicate", "2", "--dp-shard", "2"], ["--dp-shard", "2", "--tp", "2", "--sequence-parallel"],
               ["--pp", "2", "--dp-shard", "2", "--zero-stage", "1"], ["--dp-shard", "4", "--experts", "4", "--ep", "2"]],
           8: [["--pp", "2", "--dp-shard", "2", "--tp", "2"], ["--dp-shard", "8", "--zero-stage", "2"]]}


@pytest.mark.parametrize("world", sorted(PLANNED))
def test_the_planner_holds_what_a_real_run_holds(world):
    """train.py --plan builds the sharded model on the meta device under a fake process group of P ranks; what
    it reads off for each rank — parameters, master, gradients, optimizer state — equals, to the byte, what that
    rank of a real run on P gloo ranks holds after a step (lab.fsdp_demo.held_bytes): every rank, every stage."""
    from lab.plan import plan_rank
    common = ["--steps", "1", "--global-batch-size", "8", "--seq-len", "16"]
    for rank, real in enumerate(run_ranks(run_layouts, world, PLANNED[world], common, timeout=300)):
        for lay in real:
            planned = plan_rank(parse_args(common + lay["flags"].split()), rank)
            held = lay["state_bytes"]
            for k in ("parameters", "master", "gradients", "optimizer"):
                assert planned["state"][k] == held[k], (rank, lay["flags"], k, planned["state"][k], held[k])


ACTIVATIONS = {2: [["--dp-shard", "2", "--zero-stage", "3"], ["--tp", "2", "--sequence-parallel"],
                   ["--pp", "2", "--microbatches", "2", "--schedule", "zb"],
                   ["--dp-shard", "2", "--activation-checkpointing", "selective", "--dtype", "bfloat16"],
                   ["--cp", "2"], ["--cp", "2", "--cp-method", "ulysses"],
                   ["--cp", "2", "--activation-checkpointing", "selective"]],
               4: [["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "2",
                    "--layers", "4", "--tp", "2"], ["--dp-replicate", "2", "--dp-shard", "2",
                                                    "--activation-checkpointing", "full"]]}


def _real_activations(layouts, common):
    """Rank function: lab.plan.step_activations on a real Trainer of each layout (real tensors, gloo)."""
    from lab.plan import step_activations
    from mesh import DIMS, Mesh
    from train import Trainer
    out = []
    for flags in layouts:
        args = parse_args(common + flags)
        mesh = Mesh(**{d: getattr(args, d) for d in DIMS}, ep=args.ep)
        out.append(step_activations(Trainer(args, mesh, torch.device("cpu")), args, mesh))
    return out


@pytest.mark.parametrize("world", sorted(ACTIVATIONS))
def test_the_planners_activations_are_a_real_runs(world):
    """The planner runs one micro-batch's forward and backward of the real sharded model on the meta device
    (under the fake process group, with the fused attention kernel a real run takes) and counts what autograd
    and checkpointing keep for the backward (instruments.SavedBytes); a real run of the same function on P gloo
    ranks keeps as many bytes, to the byte — what autograd saves does not depend on when gloo lets go of a
    finished collective's buffers. (The formula printed beside it is the per-block one tested above, plus each
    layer's input and the logits: it leaves out the final norm, the rotary tables and the loss's own tensors.)"""
    from lab.plan import plan_rank
    common = ["--global-batch-size", "8", "--seq-len", "16"]
    for rank, real in enumerate(run_ranks(_real_activations, world, ACTIVATIONS[world], common, timeout=300)):
        for flags, kept in zip(ACTIVATIONS[world], real):   # every rank: a pipeline's stages keep different bytes
            planned = plan_rank(parse_args(common + flags), rank)
            assert kept > 0 and kept == planned["activations_measured"], (rank, flags, planned, kept)
            assert planned["activations"] == planned["activations_measured"] * planned["held"]


def test_selective_keeps_less_than_none_under_context_parallel():
    """Ring attention's blocks run inside an autograd.Function that saves what it needs itself; a selective
    policy that also kept their matmuls (S/cp × S/cp scores per block) held more than no checkpointing."""
    from lab.plan import plan_rank
    common = ["--model", "medium", "--layers", "2", "--global-batch-size", "2", "--seq-len", "1024"]
    for cp in (["--cp", "2"], ["--cp", "4"], ["--cp", "2", "--cp-method", "ulysses"]):
        kept = {how: plan_rank(parse_args(common + cp + ["--activation-checkpointing", how]), 0)["activations"]
                for how in ("none", "selective", "full")}
        assert kept["none"] > kept["selective"] > kept["full"] > 0, (cp, kept)


def test_the_planner_runs_at_scale_in_seconds():
    """The 8B model on 8, 64 and 1024 ranks: the seeds' figures for ZeRO-3 over 8 ranks in bf16 (about 2 GB of
    parameters, 4 of gradients, 12 of optimizer state with the fp32 master per GPU), 1/P of them further out."""
    import time

    from lab.plan import plan_rank
    t0 = time.perf_counter()
    for world in (8, 64, 1024):
        args = parse_args(["--model", "llama3-8b", "--dp-shard", str(world), "--dtype", "bfloat16", "--seq-len", "4096",
                           "--global-batch-size", str(world)])
        p = plan_rank(args, 0)
        psi = 8_030_261_248
        assert abs(p["state"]["parameters"] - 2 * psi / world) < 2e-3 * 2 * psi / world
        assert abs(p["state"]["gradients"] - 4 * psi / world) < 2e-3 * 4 * psi / world
        assert abs(p["state"]["master"] + p["state"]["optimizer"] - 12 * psi / world) < 2e-3 * 12 * psi / world
    assert time.perf_counter() - t0 < 60


def _measure_buffers(stage, param_dtype):
    """Rank function: a real ZeRO step of the tiny model; at each unit's reduction (the moment lab.plan._buffers
    says the transient bytes peak) the bytes of every gathered unit buffer, of the unit's local gradients and
    of the packed gradient it is about to make, counted from the tensors themselves (the optimizer's
    reduce_unit wrapped from outside). Returns (the largest, lab.plan._buffers for the same units)."""
    import torch.distributed as dist
    from fsdp import shard_model
    from lab.model import build_model
    from lab.plan import _buffers
    model = build_model("tiny", dtype=torch.float32)
    opt = shard_model(model, stage, param_dtype=param_dtype, lr=1e-3)
    seen, reduce_unit = [], opt.reduce_unit

    def measured(u):
        gathered = sum(v.buf.untyped_storage().nbytes() for v in opt.units) if stage == 3 else 0
        local = sum(p.grad.untyped_storage().nbytes() for p in u.params if p.grad is not None)
        seen.append(gathered + local + u.master.element_size() * u.flat_numel)
        return reduce_unit(u)
    opt.reduce_unit = measured
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x, x).backward()
    opt.step()
    b_p = torch.finfo(param_dtype or torch.float32).bits // 8
    return max(seen), _buffers(opt.units, stage, b_p)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_planners_buffers_are_a_real_runs_peak(stage):
    """The planner's buffers (lab.plan._buffers) equal, to the byte, the largest transient a real run holds at a
    unit's reduction — at stage 3 the unit gathered with its local gradients, the unit before it prefetched and
    the packed fp32 gradient; no root unit stays gathered (the embedding and norm + head are units) — in fp32
    and with bf16 compute copies, on every rank."""
    for dtype in (None, torch.bfloat16):
        for measured, planned in run_ranks(_measure_buffers, 2, stage, dtype, timeout=120):
            assert measured == planned, (stage, dtype, measured, planned)


def test_a_deep_pipeline_plans_each_kind_of_stage_once(monkeypatch):
    """Stages that hold the same layers' shapes (neither the first, with the embedding, nor the last, with the
    head) plan alike but for the micro-batches their schedule holds: lab.plan.plan builds one of each kind on
    meta and gives the rest its numbers at their own held count — the same as planning each (Megatron's 1T
    layout, pp 64, took 301 s one stage after another). Checked on 1F1B, zero bubble and interleaved against
    planning each stage."""
    from lab import plan
    common = ["--model", "tiny", "--layers", "16", "--seq-len", "32", "--global-batch-size", "32",
              "--dp-shard", "2"]
    real, calls = plan.plan_rank, []

    def counted(args, rank):
        calls.append(rank)
        return real(args, rank)
    for flags in (["--pp", "8", "--microbatches", "16"], ["--pp", "4", "--microbatches", "8", "--schedule", "zb",
                                                          "--activation-checkpointing", "full"],
                  ["--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--virtual-stages", "2"]):
        args = parse_args(common + flags)
        calls.clear()
        monkeypatch.setattr(plan, "plan_rank", counted)
        got = plan.plan(args)
        monkeypatch.setattr(plan, "plan_rank", real)
        assert len(calls) <= 3, (flags, calls)       # first, middle, last
        each = [real(args, r) for r in range(0, 2 * args.pp, 2)]
        assert [g["rank"] for g in got] == [e["rank"] for e in each]
        for g, e in zip(got, each):
            assert g == e, (flags, g["rank"])


def test_a_deep_model_plans_two_depths_and_carries_them(monkeypatch):
    """Without a pipeline a model's layers are alike: lab.plan.plan builds it at 2 and 3 layers on meta and
    carries every number to its depth — equal to planning all of it (a 126-layer model's meta step took ~45 s)."""
    from lab import plan
    real, calls = plan.plan_rank, []

    def counted(args, rank):
        calls.append(rank)
        return real(args, rank)
    for flags in (["--model", "medium", "--dp-shard", "4", "--tp", "2", "--sequence-parallel", "--dtype", "bfloat16"],
                  ["--model", "tiny", "--layers", "16", "--dp-shard", "2", "--zero-stage", "0"],
                  ["--model", "medium", "--cp", "2", "--dp-shard", "2", "--activation-checkpointing", "selective",
                   "--zero-stage", "2"],
                  ["--model", "tiny", "--layers", "8", "--experts", "4", "--dp-shard", "2", "--ep", "2"]):
        args = parse_args(flags + ["--seq-len", "64", "--global-batch-size", "8"])
        calls.clear()
        monkeypatch.setattr(plan, "plan_rank", counted)
        got = plan.plan(args)
        monkeypatch.setattr(plan, "plan_rank", real)
        assert len(calls) == 2 and got == [real(args, 0)], flags
