"""train.py: every layout trains to the single-process losses; checkpoints; invalid input.

The reference is lab.train_demo.reference_losses: model.py's model in ONE process (lab.baseline.single_process:
torch.optim.AdamW, torch's clip_grad_norm_, the same warm-up/cosine learning rate) on the same global
batches. Each run_ranks call trains MANY layouts of one world size in turn (lab.train_demo.run_layouts). The
parity matrix covers every pair of dimensions — ZeRO 0-3, HSDP, tp, sequence parallel, cp (ring,
Ulysses, both), pp (every schedule), ep, micro-batches and padded (token-weighted) losses — in
float64 over 3 steps, with clipping active on one; the README's headline compositions too (HSDP x tp on 8 ranks;
HSDP x tp x pp and pp x dp x cp x tp, with and without sequence parallel, on 16, over 3 steps).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from harness import Exercise, refusals, run_forked, run_ranks
from lab.train_demo import reference_losses, run_layouts
from train import check_args, lr_at, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, B, S = 3, 8, 16   # step 1 clips, 2 and 3 do not (test_clipping_is_active_in_the_reference)
# float64, short sequences, a small clip so clipping is active (the reference norms exceed it)
COMMON = ["--dtype", "float64", "--steps", str(STEPS), "--global-batch-size", str(B), "--seq-len", str(S),
          "--lr", "3e-3", "--grad-clip", "1.65"]
TOL64, TOL32 = 1e-9, 1e-5
MOE = ["--experts", "4"]


def _check(results, tol, what="", common=COMMON):
    """results: run_layouts' output on each rank. Every rank reports the same global losses, and they
    equal the single-process run of the same flags within tol."""
    for i, res in enumerate(results[0]):
        want = reference_losses(parse_args(list(common) + res["flags"].split()))
        got = res["losses"]
        assert len(got) == len(want), res["flags"]
        err = max(abs(a - b) for a, b in zip(got, want))
        assert err < tol, f"{what} layout [{res['flags']}]: max |loss diff| {err:.2e} vs single process"
        for r in results[1:]:
            assert r[i]["losses"] == got, f"ranks disagree on the global loss of [{res['flags']}]"


def _by_flags(results):
    return {lay["flags"]: lay for lay in results}


def test_lr_schedule_and_defaults():
    a = parse_args(["--lr", "1", "--warmup", "2", "--steps", "10"])
    assert [round(lr_at(s, a), 6) for s in (1, 2)] == [0.5, 1.0]
    assert lr_at(10, a) == pytest.approx(0.1) and lr_at(6, a) == pytest.approx(0.1 + 0.9 * 0.5)
    assert parse_args(["--dp-shard", "2"]).zero_stage == 3 and parse_args([]).zero_stage == 0
    assert parse_args(["--pp", "2"]).microbatches == 2
    assert parse_args(["--cp", "4", "--cp-method", "ulysses"]).cp_ulysses == 4
    assert parse_args(["--cp", "4"]).cp_ulysses == 1


def test_clipping_is_active_in_the_reference():
    """The reference clips on some steps and not on others, so the parity runs test the global norm."""
    from lab.data import get_batch, load_corpus
    from lab.baseline import single_process
    from lab.model import build_model
    args, tokens = parse_args(COMMON), load_corpus()
    out = single_process(build_model("tiny", dtype=torch.float64), [get_batch(tokens, s, B, S) for s in range(STEPS)],
                         lr=args.lr, lr_at=lambda s: lr_at(s, args), clip=args.grad_clip)
    assert max(out["norms"]) > args.grad_clip > min(out["norms"])
    assert out["losses"] == reference_losses(args)


# ---- the parity matrix -------------------------------------------------------------------------------

TWO = [["--dp-replicate", "2"]] + [["--dp-shard", "2", "--zero-stage", str(z)] for z in range(4)] + [
    ["--tp", "2"], ["--tp", "2", "--sequence-parallel"], ["--cp", "2"], ["--cp", "2", "--cp-method", "ulysses"],
    ["--pp", "2", "--schedule", "gpipe", "--microbatches", "2"], ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"],
    ["--pp", "2", "--schedule", "1f1b", "--microbatches", "1"],
    ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "2", "--layers", "4"],
    ["--pp", "2", "--schedule", "zb", "--microbatches", "2"],
    ["--dp-shard", "2", "--activation-checkpointing", "full", "--microbatches", "2"],
    ["--dp-shard", "2", "--pad-share", "0.6"], ["--cp", "2", "--pad-share", "0.6", "--microbatches", "2"]]
TWO_MOE = [["--dp-shard", "2", "--ep", "2", "--zero-stage", str(z)] for z in range(4)] + [
    ["--dp-replicate", "2", "--ep", "2"], ["--tp", "2"], ["--cp", "2"], ["--pp", "2", "--microbatches", "2"],
    ["--dp-shard", "2", "--ep", "2", "--microbatches", "2"]]


# ---- one spawned group per world size: every test's layouts of that size train in it, each layout once ----------

def _spawned(world, groups, timeout):
    """groups: name -> layouts (flags after COMMON). Trains every distinct layout once, in one run_ranks call
    on `world` ranks; returns name -> per-rank lists of results, in each group's order."""
    unique = list(dict.fromkeys(" ".join(lay) for layouts in groups.values() for lay in layouts))
    res = run_ranks(run_layouts, world, [flags.split() for flags in unique], COMMON, timeout=timeout)
    by = [_by_flags(r) for r in res]
    return {name: [[b[" ".join(lay)] for lay in layouts] for b in by] for name, layouts in groups.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank layout of this module's tests (see each test for what it checks)."""
    resume_dir = tmp_path_factory.mktemp("resume")
    return dict(_spawned(2, dict(alone=TWO + [MOE + lay for lay in TWO_MOE], zero0=ZERO0_TWO, pad=PAD,
                                 dtypes=F32 + BF16, resume=_resume_layouts(resume_dir), gpt=GPT_TWO), timeout=1200),
                resume_dir=resume_dir)


@pytest.fixture(scope="module")
def four_ranks():
    """Every 4-rank layout of this module's tests."""
    return _spawned(4, dict(combinations=FOUR + [MOE + lay for lay in FOUR_MOE] + [META], zero0=ZERO0_FOUR,
                            gpt=GPT_FOUR), timeout=900)


def test_world_1_and_every_dimension_alone_on_2_ranks(two_ranks):
    """Each dimension alone (every ZeRO stage, every schedule, ring and Ulysses), and experts with
    each of ZeRO 0-3, tp, cp, pp and micro-batches."""
    _check(run_ranks(run_layouts, 1, [[]], COMMON, timeout=120), TOL64, "world 1")
    res = two_ranks["alone"]
    _check(res, TOL64, "2 ranks")
    for rank in res:   # every rank against the formulas, each with its own units (a pipeline stage its own)
        _check_bytes_and_memory(_by_flags(rank))


def _check_bytes_and_memory(by):
    """One rank's last step against the formulas (API bytes; float64 = 8 bytes per element).
    Every layout also all-reduces one float64 for the global gradient norm (+8 bytes)."""
    from lab.fsdp_demo import zero_comm_formula, zero_state_formula
    from lab.model import get_config
    from lab.ring_attention_demo import ring_bytes
    cfg, b = get_config("tiny"), 8
    L, H, P = cfg.n_layers, cfg.dim, 2
    for z in range(4):
        lay = by[f"--dp-shard 2 --zero-stage {z}"]
        numel = sum(n for n, _, _, _ in lay["zero_units"])
        root = 0  # the course's model leaves nothing to the root unit (embedding, norm + head are units)
        want = zero_comm_formula(z, numel, P, b, root)  # gradients are reduced in fp32 -- here float64
        want = {k: v * b // 4 if k != "all_gather" else v for k, v in want.items()}
        got = {k: v["bytes"] for k, v in lay["comm_summary"].items()}
        # + the used-flags agreement (one int32 per parameter) and the clipping norm (one float64)
        got["all_reduce"] = got.get("all_reduce", 0) - 8 - _flag_bytes(lay)
        assert {k: v for k, v in got.items() if v} == want, (z, got, want)
        mem, form = lay["state_bytes"], zero_state_formula(z, numel, P, b, 0, b, 2 * b)
        assert mem["parameters"] == form["parameters"], (z, mem, form)
        assert 0 <= mem["optimizer"] - form["optimizer"] <= 8 * 40, (z, mem, form)  # + AdamW's step counters
    # tp 2: forward 1 (embedding) + 2 per layer + 3 (vocab-parallel loss, [B·S] each); backward 2 per
    # layer + 1 (head input): all-reduces of [B, S, H]
    tp = by["--tp 2"]["comm_summary"]["all_reduce"]
    assert tp["bytes"] - 8 - _flag_bytes(by["--tp 2"]) == (4 * L + 2) * B * S * H * b + 3 * B * S * b
    # pp 2: stage 0 sends m activations [B/m, S, H] and receives m gradients of them
    for flags in ("--pp 2 --schedule gpipe --microbatches 2", "--pp 2 --schedule 1f1b --microbatches 4"):
        pp = by[flags]["comm_summary"]
        assert pp["send"]["bytes"] == pp["recv"]["bytes"] == B * S * H * b, (flags, pp)
    # cp 2 (ring, zigzag): per layer k, v pass once forward, once backward plus dk, dv home
    fwd, bwd = ring_bytes(B, S // 2, cfg.n_kv_heads, cfg.head_dim, 2, b)
    assert by["--cp 2"]["comm_summary"]["send"]["bytes"] == L * (fwd + bwd)


def _flag_bytes(lay):
    """The all-reduce that agrees which parameters got a gradient on any rank: fsdp.py's one int32 per
    parameter of the ZeRO units whose group has more than one rank, or at ZeRO-0 ddp.py's one byte per
    parameter of its buckets on such a group (the units then move nothing: size 1)."""
    return 4 * sum(n for _, _, size, n in lay["zero_units"] if size > 1) + \
        sum(n for _, _, ranks, n in lay["ddp_buckets"] if len(ranks) > 1)


FOUR = [["--dp-replicate", "2", "--dp-shard", "2"], ["--dp-shard", "2", "--tp", "2"], ["--cp", "2", "--tp", "2"],
        ["--pp", "2", "--tp", "2", "--microbatches", "2"], ["--tp", "4"],
        ["--pp", "2", "--dp-shard", "2", "--microbatches", "2", "--schedule", "gpipe"],
        ["--pp", "2", "--dp-shard", "2", "--zero-stage", "1", "--microbatches", "2"],
        ["--pp", "2", "--dp-shard", "2", "--zero-stage", "1", "--microbatches", "4", "--schedule", "zb"],
        ["--pp", "2", "--dp-replicate", "2", "--microbatches", "2", "--schedule", "interleaved",
         "--virtual-stages", "2", "--layers", "4"],
        ["--pp", "2", "--tp", "2", "--schedule", "zb", "--microbatches", "2"],
        ["--dp-shard", "2", "--cp", "2"], ["--pp", "2", "--cp", "2", "--microbatches", "2"],
        ["--cp", "4", "--cp-method", "ulysses", "--cp-ulysses", "2"],
        # sequence parallel with every ZeRO stage that reduces in backward, and with pp
        ["--dp-shard", "2", "--tp", "2", "--sequence-parallel", "--zero-stage", "2"],
        ["--dp-shard", "2", "--tp", "2", "--sequence-parallel", "--zero-stage", "3"],
        ["--pp", "2", "--tp", "2", "--sequence-parallel", "--microbatches", "2"],
        ["--dp-shard", "2", "--cp", "2", "--pad-share", "0.6", "--zero-stage", "2"]]
FOUR_MOE = [["--dp-shard", "2", "--ep", "2", "--tp", "2"], ["--dp-shard", "2", "--ep", "2", "--tp", "2",
            "--sequence-parallel", "--zero-stage", "3"], ["--dp-shard", "2", "--ep", "2", "--cp", "2"],
            ["--dp-shard", "2", "--ep", "2", "--pp", "2"], ["--dp-shard", "4", "--ep", "2", "--zero-stage", "2"],
            ["--dp-shard", "4", "--ep", "2", "--zero-stage", "3"],
            ["--dp-shard", "4", "--ep", "4", "--zero-stage", "3", "--microbatches", "2"],
            ["--dp-replicate", "2", "--dp-shard", "2", "--ep", "2", "--zero-stage", "3"]]


# float32 too (every layout is built on the meta device: each rank materialises only its shard of its tp slice)
META = ["--dp-shard", "2", "--tp", "2", "--dtype", "float32"]


def test_combinations_on_4_ranks(four_ranks):
    res = four_ranks["combinations"]
    _check([r[:-1] for r in res], TOL64, "4 ranks")
    _check([r[-1:] for r in res], TOL32, "float32 meta-initialised")
    for rank in res:
        _check_composed_bytes(_by_flags(rank))


def _check_composed_bytes(by):
    """A composition's bytes are the sum of its lessons' (one rank, last step, float64 API bytes)."""
    from lab.fsdp_demo import zero_comm_formula
    from lab.model import get_config
    cfg, b = get_config("tiny"), 8
    L, H, Bl = cfg.n_layers, cfg.dim, B // 2
    # dp_shard 2 x tp 2: ZeRO-3 on this rank's tp slice + tp's all-reduces on the local batch B/2
    lay = by["--dp-shard 2 --tp 2"]
    numel, root = sum(n for n, _, _, _ in lay["zero_units"]), 0  # (no parameter in the root unit)
    z = zero_comm_formula(3, numel, 2, b, root)
    got = {k: v["bytes"] for k, v in lay["comm_summary"].items()}
    assert got["all_gather"] == z["all_gather"] and got["reduce_scatter"] == 2 * z["reduce_scatter"]
    assert got["all_reduce"] - 8 - _flag_bytes(lay) == (4 * L + 2) * Bl * S * H * b + 3 * Bl * S * b
    # pp 2 x dp_shard 2 with ZeRO-3: the units stay gathered over the m micro-batches and reduce once,
    # so the bytes do not grow with m (b·Ψ gathered, 4Ψ -- here 8Ψ -- reduce-scattered), and stage 0
    # sends its activations; ZeRO-1 moves the same bytes
    for flags in ("--pp 2 --dp-shard 2 --microbatches 2 --schedule gpipe",
                  "--pp 2 --dp-shard 2 --zero-stage 1 --microbatches 2"):
        lay = by[flags]
        numel = sum(n for n, _, _, _ in lay["zero_units"])
        got = {k: v["bytes"] for k, v in lay["comm_summary"].items()}
        assert got["all_gather"] == numel * b and got["reduce_scatter"] == numel * b, (flags, got, numel)
        assert got["send"] == got["recv"] == Bl * S * H * b, got
    # experts under ZeRO 2 and 3: dense units sharded over dp_shard (4 ranks), expert units over edp_cp
    # (dp/ep = 2 ranks); each part moves and holds what the ZeRO formulas give for its own group
    from lab.fsdp_demo import zero_state_formula
    for z in (2, 3):
        lay = by[" ".join(MOE + ["--dp-shard", "4", "--ep", "2", "--zero-stage", str(z)])]
        parts = {}  # group size -> padded elements of the units sharded over it
        for n, _, size, _ in lay["zero_units"]:
            parts[size] = parts.get(size, 0) + n
        assert set(parts) == {4, 2}, lay["zero_units"]
        root = 0  # (no parameter in the root unit: embedding, norm + head are units of their own)
        for size, numel in parts.items():
            want = zero_comm_formula(z, numel, size, b, root if size == 4 else 0)
            got = {op: sum(n for o, ranks, n in lay["comm_events"] if o == op and len(ranks) == size)
                   for op in ("reduce_scatter", "all_gather")}
            assert got == {"reduce_scatter": want["reduce_scatter"] * b // 4, "all_gather": want["all_gather"]}, \
                (z, size, got, want)
        form = [zero_state_formula(z, numel, size, b, 0, b, 2 * b) for size, numel in parts.items()]
        mem = lay["state_bytes"]
        for k in ("parameters", "gradients"):
            assert mem[k] == sum(f[k] for f in form), (z, k, mem, form)
        assert 0 <= mem["optimizer"] - sum(f["optimizer"] for f in form) <= 8 * 40, (z, mem, form)  # + step counters


# The GPT-family options (lab/model.py) on every strategy. tiny-gpt2: LayerNorm with biases, a GELU MLP, learned
# positions, biases on the linears, the head tied to the embedding, a padded vocabulary (257 rows -> 320);
# tiny-bloom: ALiBi, the embedding's norm, grouped kv heads with biases (tp 4 replicates them). 4 steps each: every
# one of tiny-gpt2's clips, two of tiny-bloom's at --grad-clip 1.3.
GPT = ["--model", "tiny-gpt2", "--steps", "4"]
BLOOM = ["--model", "tiny-bloom", "--steps", "4", "--grad-clip", "1.3"]
GPT_TWO = [GPT + ["--dp-replicate", "2"], GPT + ["--dp-shard", "2", "--zero-stage", "3"],
           GPT + ["--tp", "2", "--sequence-parallel"], GPT + ["--cp", "2"],
           GPT + ["--pp", "2", "--schedule", "zb", "--microbatches", "2"], BLOOM + ["--tp", "2"],
           GPT + ["--experts", "4", "--dp-shard", "2", "--ep", "2", "--zero-stage", "1"]]
GPT_FOUR = [GPT + ["--dp-replicate", "2", "--dp-shard", "2"],
            GPT + ["--pp", "2", "--tp", "2", "--sequence-parallel", "--microbatches", "2"],
            GPT + ["--cp", "2", "--tp", "2", "--sequence-parallel"], BLOOM + ["--tp", "4"],
            BLOOM + ["--pp", "2", "--dp-shard", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                     "--layers", "4", "--microbatches", "2"],
            GPT + ["--experts", "4", "--dp-shard", "2", "--ep", "2", "--tp", "2"]]


def test_gpt_family_options_on_every_strategy(two_ranks, four_ranks):
    """Data parallel, ZeRO-3 (the tied matrix used in two units), HSDP, tp with and without sequence parallel (biases
    cut with a column-parallel linear's rows, added once after a row-parallel one's sum; LayerNorm's and positions'
    gradients partial under SP; ALiBi's slopes per tp rank's heads; a padded vocabulary's logits masked), cp (learned
    positions at each rank's zigzag positions, with SP too), pp with every tied-embedding case (zero bubble,
    interleaved, with tp) and ep (GELU experts, with tp): the single-process losses on every rank. In a pipeline the
    first and last stage all-reduce the tied matrix's gradient once a step: V·H elements, nothing else that size."""
    from lab.model import get_config
    _check(two_ranks["gpt"], TOL64, "GPT options, 2 ranks")
    _check(four_ranks["gpt"], TOL64, "GPT options, 4 ranks")
    cfg = get_config("tiny-gpt2")
    for lay in (rank[4] for rank in two_ranks["gpt"]):
        tied = [b for op, _, b in lay["comm_events"] if op == "all_reduce" and b == cfg.padded_vocab * cfg.dim * 8]
        assert len(tied) == 1, lay["comm_events"]


SMALL_BUCKETS = ["--bucket-mb", "0.02"]  # tiny's 273 KiB of fp64 gradients in several buckets
V2 = ["--virtual-stages", "2", "--layers", "4"]
ZERO0_TWO = [["--dp-replicate", "2", "--microbatches", "2"] + SMALL_BUCKETS, ["--cp", "2"] + SMALL_BUCKETS,
             ["--dp-replicate", "2"]]
ZERO0_FOUR = [["--pp", "2", "--dp-replicate", "2", "--schedule", "zb", "--microbatches", "4"] + SMALL_BUCKETS,
              ["--pp", "2", "--dp-replicate", "2", "--schedule", "interleaved", "--microbatches", "2"] + V2
              + SMALL_BUCKETS,
              ["--dp-replicate", "2", "--tp", "2", "--microbatches", "2"] + SMALL_BUCKETS,
              MOE + ["--dp-replicate", "4", "--ep", "2"] + SMALL_BUCKETS] + [
    ["--pp", "2", "--dp-replicate", "2", "--schedule", s, "--microbatches", m, "--steps", "3"] + SMALL_BUCKETS
    + (V2 if s == "interleaved" else []) for s, m in (("gpipe", "2"), ("gpipe", "4"), ("1f1b", "2"), ("1f1b", "4"),
                                                     ("zb", "2"), ("interleaved", "4"))]


def test_zero_stage_0_is_lesson_1s_buckets_overlapped_with_the_last_backward(two_ranks, four_ranks):
    """At ZeRO-0 the gradients are averaged by ddp.BucketedDDP: one all-reduce per bucket, in bucket order, ONCE a
    step — not per micro-batch, nor per pipeline action — then its used flags (a byte per parameter) and the
    clipping norm; the ZeRO units move nothing. Experts get buckets on their own group (edp). Equal to one process
    on dp, cp, tp, pp (every schedule, 2 and 4 micro-batches) and ep. On EVERY rank — every pipeline stage — the
    buckets are launched inside the last backward that adds to a gradient (counted: the autograd pass that launched
    each, train_demo.StepMeter), none after it by synchronize(), and, but under interleaved 1F1B, some by their hooks
    while it computes; the step log's share of all-reduce time hidden in backward is measured."""
    from lab.model import get_config, num_params
    res2, res4 = two_ranks["zero0"], four_ranks["zero0"]
    _check(res2, TOL64, "ZeRO-0, 2 ranks")
    _check(res4, TOL64, "ZeRO-0, 4 ranks")
    whole = num_params(get_config("tiny"))
    for rank, lay in ((r, lay) for res in (res2, res4) for r, lays in enumerate(res) for lay in lays):
        buckets, flags = lay["ddp_buckets"], lay["flags"]
        where = f"rank {rank} [{flags}]"
        assert buckets and all(size == 1 for _, _, size, _ in lay["zero_units"]), where   # ZeRO moves nothing
        if "--bucket-mb 0.02" in flags:
            assert len(buckets) >= 3, (where, buckets)
        if flags == "--dp-replicate 2":
            assert len(buckets) == 1 and buckets[0][0] == whole   # 137 KiB: one bucket of every gradient
        by_group = {}
        for n, e, ranks, k in buckets:
            by_group.setdefault(tuple(ranks), []).append(n * e)
        for ranks, sizes in by_group.items():
            got = [b for op, r, b in lay["comm_events"] if op == "all_reduce" and tuple(r) == ranks]
            flag_bytes = sum(k for _, _, r, k in buckets if tuple(r) == ranks)
            # the buckets once, then the flags (and, where the group is the world, the clipping norm's float64;
            # a MoE also all-reduces its routing statistics on the same ranks, left out here)
            got = [b for b in got if b in sizes or b == flag_bytes] if "--experts" in flags else got
            assert got[:len(sizes) + 1] == sizes + [flag_bytes] and got[len(sizes) + 1:] in ([], [8]), (where, got)
        # every step: the buckets' bytes once, all launched inside the last of the m·v backwards that add to a
        # gradient (its hooks, or its end), none by synchronize() after it
        m = int(flags.split("--microbatches ")[1].split()[0]) if "--microbatches" in flags else 1
        v = 2 if "--virtual-stages 2" in flags else 1
        once = sum(n * e for n, e, ranks, _ in buckets if len(ranks) > 1)
        for step in lay["ddp_launches"]:
            assert step["backwards"] == m * v, (where, step)
            assert step["bytes"] == step["in_last_backward"] == once and step["after_backward"] == 0, (where, step)
            # interleaved: the rank's last backward is its first chunk's, whose buckets come last in bucket order
            # (backward's order of the stage's parameters): they wait for the second chunk's, launched at its end
            assert step["by_hooks"] > 0 or "interleaved" in flags, (where, step)
        assert 0 <= lay["ddp_overlap"] <= 1, where
    assert res2[0][0]["ddp_overlap"] > 0 and res2[0][1]["ddp_overlap"] > 0, [lay["ddp_overlap"] for lay in res2[0]]
    moe = res4[0][3]["ddp_buckets"]
    assert {len(ranks) for _, _, ranks, _ in moe} == {4, 2}   # dense over dp 4, my experts over the 2 ranks holding them


def test_8_ranks():
    """Experts on every rank; Ulysses over cp 4 inside dp_shard 2; 3-D layouts."""
    layouts = [["--dp-shard", "8", "--ep", "8", "--experts", "8"],
               ["--dp-shard", "2", "--cp", "4", "--cp-method", "ulysses"],
               ["--pp", "2", "--dp-shard", "2", "--tp", "2", "--microbatches", "2"],
               ["--dp-shard", "2", "--tp", "4", "--zero-stage", "3"],
               ["--pp", "2", "--dp-shard", "2", "--tp", "2", "--sequence-parallel"] + MOE + ["--ep", "2"],
               # the README's 2-node HSDP x tp command (dp_replicate 2 x dp_shard 2 x tp 4), at tp 2
               ["--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"]]
    _check(run_ranks(run_layouts, 8, layouts, COMMON, timeout=600), TOL64, "8 ranks")


def test_16_ranks_hsdp_tp_pp_and_4d():
    """The README's headline compositions at 16 ranks: HSDP x tp x pp, and pp x dp x cp x tp with and without
    sequence parallel (zigzag cp 2 and sp over tp 2 both divide --seq-len 16). Every rank's losses equal rank 0's
    and one process's in float64, over 3 steps (16 gloo processes on a small machine are slow)."""
    common = COMMON + ["--steps", "3"]
    layouts = [["--pp", "2", "--dp-replicate", "2", "--dp-shard", "2", "--tp", "2", "--microbatches", "2"],
               ["--pp", "2", "--dp-shard", "2", "--cp", "2", "--tp", "2", "--microbatches", "2"],
               ["--pp", "2", "--dp-shard", "2", "--cp", "2", "--tp", "2", "--microbatches", "2", "--sequence-parallel"]]
    res = run_ranks(run_layouts, 16, layouts, common, timeout=600)
    _check(res, TOL64, "16 ranks", common=common)
    for i, flags in enumerate(layouts):   # each rank a different place on the mesh: every dimension is used
        places = {tuple(r[i]["coords"].values()) for r in res}
        assert len(places) == 16 and all(len(r[i]["losses"]) == 3 for r in res), flags


PAD = [["--dp-shard", "2", "--pad-share", "0.6", "--steps", "1"]]


def test_token_weighted_loss_differs_from_a_mean_of_means(two_ranks):
    """With padding, ranks hold different numbers of counted tokens: the global token-weighted mean
    (what one process computes, and train.py) differs from the mean of the ranks' mean losses."""
    from lab.data import get_batch, load_corpus
    from lab.model import build_model
    model = build_model("tiny", dtype=torch.float64)
    x, y = get_batch(load_corpus(), 0, B, S, pad_share=0.6)
    counted = (y != -100).sum(1)
    assert len(set(counted.tolist())) > 1  # the rows really differ
    with torch.no_grad():
        one = model(x, y).item()
        halves = [model(x[:B // 2], y[:B // 2]).item(), model(x[B // 2:], y[B // 2:]).item()]
    assert abs(sum(halves) / 2 - one) > 1e-3       # the naive per-rank mean of means is wrong
    got = two_ranks["pad"]
    for rank in got:
        assert abs(rank[0]["losses"][0] - one) < TOL64  # ours is the global token mean, on every rank


F32 = [["--dtype", "float32"] + lay for lay in (["--dp-shard", "2"], ["--tp", "2"], ["--pp", "2", "--schedule", "zb"],
                                                MOE + ["--dp-shard", "2", "--ep", "2"])]
BF16 = [["--dtype", "float32"] + lay for lay in (["--dp-shard", "2", "--dtype", "bfloat16"],
                                                 ["--tp", "2", "--dtype", "bfloat16"])]


def test_float32_and_bfloat16_tolerance(two_ranks):
    """float32 within 1e-5 of the float32 single-process run; bf16 compute (fp32 master weights,
    optimizer and reductions) within 2e-2 of it."""
    res = two_ranks["dtypes"]
    _check([r[:len(F32)] for r in res], TOL32, "float32")
    _check([r[len(F32):] for r in res], 2e-2, "bfloat16")


def _resume_layouts(tmp_path):
    layouts = []
    for i, lay in enumerate((["--dp-shard", "2", "--zero-stage", "3"], ["--dp-shard", "2", "--zero-stage", "1"],
                             ["--tp", "2"], MOE + ["--dp-shard", "2", "--ep", "2", "--zero-stage", "2"])):
        d = str(tmp_path / f"ckpt{i}")
        layouts += [lay + ["--stop-at", str(STEPS - 1), "--save", d], lay + ["--resume", d]]
    return layouts


def test_save_then_resume_to_the_end_equals_uninterrupted(two_ranks):
    """Saved one step before the end, resumed for the last: ZeRO-3 and ZeRO-1 shards, a tensor-parallel model and
    experts, each rank its own shards."""
    res = two_ranks["resume"]
    for i in range(0, len(res[0]), 2):
        want = reference_losses(parse_args(COMMON + res[0][i]["flags"].split()))
        for rank, lays in enumerate(res):  # every rank reports the global losses
            first, second = lays[i], lays[i + 1]
            assert len(first["losses"]) == STEPS - 1 and second["start"] == STEPS - 1 and len(second["losses"]) == 1, rank
            err = max(abs(a - b) for a, b in zip(first["losses"] + second["losses"], want))
            assert err < TOL64, (rank, first["flags"], err)
        saved = two_ranks["resume_dir"] / f"ckpt{i // 2}" / f"step_{STEPS - 1:08d}"
        assert sorted(os.listdir(saved)) == ["meta.json", "rank0.pt", "rank1.pt"]


INVALID = [
    (["--dp-shard", "3"], 2, "world size is 2"),
    (["--tp", "3"], 3, "does not divide the model's n_heads"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "3",
      "--global-batch-size", "6", "--layers", "4"], 2, "multiple of p=2"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "2"], 2,
     "layers cannot fill 4 stages"),
    (["--dp-shard", "2", "--global-batch-size", "6", "--microbatches", "2"], 2, "not divisible by the data-parallel"),
    (["--dp-shard", "2", "--experts", "3", "--ep", "2"], 2, "not divisible by ep=2"),
    (["--data", "/no/such/file.txt"], 1, "does not exist"),
    (["--pp", "3"], 3, "layers cannot fill 3 stages"),
    (["--cp", "2", "--seq-len", "6"], 2, "cuts it into 2*cp = 4 equal chunks"),
    (["--cp", "4", "--cp-method", "ulysses", "--seq-len", "16", "--model", "small"], 4, "query heads over 4 ranks"),
    (["--ep", "2", "--dp-shard", "2"], 2, "needs a mixture-of-experts"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "9"], 2, "--sequence-parallel splits"),
    (["--global-batch-size", "0"], 1, "--global-batch-size 0 must be >= 1"),
    (["--seq-len", "0"], 1, "--seq-len 0 must be >= 1"),
    (["--seq-len", "-3"], 1, "--seq-len -3 must be >= 1"),
    (["--steps", "0"], 1, "--steps 0 must be >= 1"),
    (["--pad-share", "1.5"], 1, "--pad-share 1.5 must be in"),
    (["--model", "tiny-bloom", "--cp", "2"], 2, "--cp with ALiBi positions"),
    (["--model", "tiny-bloom", "--export", "bloom", "--export-format", "hf"], 1, "only as Llama, Mixtral or GPT-2"),
    (["--model", "tiny-gpt2", "--tp", "2", "--compare"], 2, "none of lab/model.py's GPT-family options"),
]


@pytest.mark.parametrize("flags, world, msg", INVALID)
def test_invalid_layouts_are_named(flags, world, msg):
    with pytest.raises(ValueError, match=msg.replace("*", r"\*")):
        check_args(parse_args(flags), world)


def test_data_too_short_is_named(tmp_path):
    for text, size in (("", 0), ("abcdefgh", 8)):
        f = tmp_path / f"d{size}.txt"
        f.write_text(text)
        with pytest.raises(ValueError, match=f"holds {size} bytes .* at least 17 bytes"):
            check_args(parse_args(["--data", str(f), "--seq-len", "16"]), 1)


def test_every_invalid_layout_fails_on_every_rank_before_any_collective():
    res = run_ranks(refusals, 2, [f for f, _, _ in INVALID], timeout=60)
    for codes in res:
        for (flags, _, msg), (err, calls) in zip(INVALID, codes):
            assert err is not None and msg in err and calls == 0, (flags, err)


def _torchrun(n, flags, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    from lab.launch import free_port  # not torchrun's default port: other jobs may hold it
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                           "--master_port", str(free_port()), os.path.join(ROOT, "train.py")] + flags,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_invalid_layout_under_torchrun_fails_on_every_rank_without_hanging():
    p = _torchrun(2, ["--dp-shard", "2", "--global-batch-size", "5"], timeout=90)
    assert p.returncode != 0
    for r in range(2):
        assert f"[rank {r}] error: invalid training layout" in p.stderr, p.stderr[-2000:]
    assert "use a multiple of 2" in p.stderr and 'train.py", line' not in p.stderr


def test_resume_with_nothing_left_exits_the_same_on_every_rank(tmp_path):
    # (torchrun's ranks forked from the harness's server: the real torchrun starts train.py in the tests around)
    d, run = str(tmp_path / "ckpt"), ["-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py", "--dp-shard",
                                      "2", "--steps", "2", "--seq-len", "16"]
    run_forked(run + ["--save", d, "--quiet"], cwd=ROOT, timeout=120)
    again = run_forked(run + ["--resume", d, "--check"], cwd=ROOT, timeout=120, expect_fail=True)
    assert 'train.py", line' not in again  # no traceback of ours
    for r in range(2):
        assert f"[rank {r}] error: invalid training layout" in again and "nothing is left" in again


def test_torchrun_demo_log_file_check_and_compare(tmp_path):
    """4 ranks, dp_shard 2 x tp 2: per-step lines, JSON log, --check (one process on rank 0) and
    --compare (PyTorch's FSDP2 + DTensor TP on the same layout, same losses)."""
    log = tmp_path / "log.jsonl"
    p = _torchrun(4, ["--dp-shard", "2", "--tp", "2", "--steps", "3", "--seq-len", "16", "--log-file", str(log),
                      "--check", "--compare"], timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Warning" not in p.stderr, p.stderr[-2000:]
    assert p.stdout.count("tokens/s") == 3 and "comm" in p.stdout
    assert "losses vs the single-process run" in p.stdout and "-> ok" in p.stdout, p.stdout
    line = next(x for x in p.stdout.splitlines() if x.startswith("PyTorch FSDP2"))
    assert float(line.split("max |loss diff| ")[1].split(";")[0]) < 1e-5, line
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 and r["comm_bytes"] > 0


def test_plain_python_runs():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--steps", "2", "--seq-len", "16"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and p.stdout.count("tokens/s") == 2, p.stderr[-2000:]
    assert "Warning" not in p.stderr


# ---- the README's exercises ------------------------------------------------------------------------------

def _check_ok(out):
    line = next(l for l in out.splitlines() if l.startswith("losses vs the single-process run"))
    assert line.endswith("-> ok") and float(line.split("max |diff| ")[1].split()[0]) < 1e-9, line


def _last_step(out):
    line = [l for l in out.splitlines() if l.startswith("step ")][-1]
    api = float(line.split("comm ")[1].split(" MiB")[0])
    ring = float(line.split("(ring ")[1].split(",")[0])
    total = float(out.split("model state on rank 0 after a step: ")[1].split("total ")[1].split(" KiB")[0])
    return api, ring, total


PSI, ROOT_PSI, MIB = 34_976, 0, 2**20  # the tiny model's parameters; its root unit's (none: every one is in a unit)


def _check_zero0(out):
    api, ring, total = _last_step(out)
    assert abs(ring - 1.5 * 4 * PSI / MIB) < 2e-3 and abs(total - 16 * PSI / 1024) < 0.5, (api, ring, total)


def _check_zero3(out):
    api, ring, total = _last_step(out)
    ring0 = 1.5 * 4 * PSI / MIB                                   # ZeRO-0's ring bytes, 2(P-1)/P of 4Ψ
    assert abs(ring - 0.75 * 4 * (3 * PSI - ROOT_PSI) / MIB) < 2e-3 and abs(ring / ring0 - 1.5) < 0.02
    assert abs(api / (4 * PSI / MIB) - 3.0) < 0.03 and abs(total - 4 * PSI / 1024) < 0.5, (api, ring, total)


def _check_resumed(out):
    steps = [int(l.split()[1]) for l in out.splitlines() if l.startswith("step ")]
    assert steps == [6, 7, 8, 9, 10] and "resuming after step 5" in out
    assert "-> ok" in out  # --check compares the 5 resumed losses with steps 6-10 of one process


def _check_resumed_elsewhere(out):
    assert "resuming after step 5" in out and "-> ok" in out
    assert "Mesh(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2" in out
    line = next(l for l in out.splitlines() if l.startswith("resumed after step 5"))
    assert "peak host memory per rank +" in line, line


def _check_crash(out):
    assert "[rank 1] --fail-at 5: dying after step 5" in out and "resuming after step 4" in out
    fives = [l.split()[3] for l in out.splitlines() if l.startswith("step    5 ")]
    assert len(fives) == 2 and fives[0] == fives[1], fives  # step 5 before the crash and after: the same loss


def _check_export(out):
    assert "exported to model.pt" in out


def _check_init(mode):
    def check(out):  # float32: the run's own tolerance, 1e-4
        ok = next(l for l in out.splitlines() if l.startswith("losses vs the single-process run"))
        assert ok.endswith("-> ok") and float(ok.split("max |diff| ")[1].split()[0]) < 1e-4, ok
        line = next(l for l in out.splitlines() if l.startswith("started from model.pt"))
        assert f"--init-read {mode}" in line, line
    return check


def _check_mismatch(out):
    assert "MISMATCH" in out and "first difference from one process: step 1, the loss, every rank" in out, out[-3000:]


SAVE = "torchrun --nproc_per_node 4 train.py --pp 2 --dp-shard 2 --steps 10 --stop-at 5 --save ckpt"
SMALL = "--model small --steps 2 --seq-len 16 --global-batch-size 4"
EXPORT = f"torchrun --nproc_per_node 4 train.py --dp-shard 2 --tp 2 {SMALL} --export model.pt"
INIT = f"torchrun --nproc_per_node 4 train.py --dp-shard 4 {SMALL} --init-from model.pt"
MEM = "--model tiny --steps 2 --seq-len 16 --global-batch-size 4 --track-memory"
XL = "--seq-len 1024 --global-batch-size 8 --device-memory 80GB"
L7 = "--dtype bfloat16 --seq-len 4096 --global-batch-size 16 --activation-checkpointing selective --device-memory 80GB"
def _bytes_per_parameter(out):
    return float(out.split("bytes per parameter of the model")[0].rsplit("(", 1)[1])


def _launched(out):
    """Step 2's bucket all-reduces (ZeRO-0): MiB launched before backward produced its last gradient, of all MiB
    launched — counted in order, not timed, so the same on a busy machine."""
    line = next(l for l in out.splitlines() if "launched before backward's last gradient" in l)
    early, total = line.split("last gradient ")[1].split(" MiB")[0].split(" of ")
    return float(early), float(total)


def _check_launched(low, high):
    def check(out):
        early, total = _launched(out)
        assert total == 36.8 and low <= early <= high and _last_step(out)[0] == 36.769, out[-1500:]  # Ψ·4, once
    return check


def _check_ddp_memory(per_parameter):
    def check(out):
        assert _bytes_per_parameter(out) == per_parameter and out.count("peak tracked") == 2, out[-1500:]
    return check


def _planned_state(out):
    """GB of parameters + master + gradients + optimizer on the device, rank 0's plan."""
    rows = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
            if line.strip().startswith(("parameters", "master", "gradients", "optimizer"))}
    return sum(rows.values())


def _check_plan(state_gb):
    def check(out):
        assert abs(_planned_state(out) - state_gb) < 0.05 and "fits 80GB: yes" in out, out
    return check


OVERLAP = "--model small --seq-len 128 --steps 4"
EXERCISES = [
    Exercise("torchrun --nproc_per_node 8 train.py --pp 2 --dp-shard 2 --tp 2 --dtype float64 --check", _check_ok),
    Exercise("torchrun --nproc_per_node 8 train.py --dp-shard 4 --tp 2 --experts 8 --ep 4 --pad-share 0.5 "
             "--dtype float64 --check", _check_ok),
    Exercise("torchrun --nproc_per_node 4 train.py --dp-shard 4 --zero-stage 0 --steps 3", _check_zero0),
    Exercise("torchrun --nproc_per_node 4 train.py --dp-shard 4 --zero-stage 3 --steps 3", _check_zero3),
    Exercise("torchrun --nproc_per_node 4 train.py --pp 2 --dp-shard 2 --steps 10 --resume ckpt --check",
             _check_resumed, setup=(SAVE,)),
    Exercise("torchrun --nproc_per_node 2 train.py --tp 2 --steps 10 --resume ckpt --check", _check_resumed_elsewhere,
             setup=(SAVE,)),
    Exercise("torchrun --nproc_per_node 2 --max-restarts 1 train.py --dp-shard 2 --steps 8 --save ckpt --save-every 2 "
             "--resume auto --fail-at 5", _check_crash),
    Exercise(EXPORT, _check_export),
    Exercise(INIT + " --check", _check_init("every-rank"), setup=(EXPORT,)),
    Exercise(INIT + " --init-read rank-0 --check", _check_init("rank-0"), setup=(EXPORT,)),
    Exercise(f"torchrun --nproc_per_node 4 train.py --dp-replicate 4 {MEM}", _check_ddp_memory(16.0)),
    Exercise(f"torchrun --nproc_per_node 4 train.py --dp-shard 4 {MEM}", _check_ddp_memory(4.0)),
    Exercise(f"python train.py --plan --model gpt2-xl --dp-replicate 8 {XL}", _check_plan(24.92)),
    Exercise(f"python train.py --plan --model gpt2-xl --dp-shard 8 {XL}", _check_plan(3.12)),
    Exercise(f"python train.py --plan --model llama2-7b --dp-replicate 2 --dp-shard 8 {L7}", _check_plan(15.16)),
    Exercise(f"python train.py --plan --model llama2-7b --dp-shard 16 {L7}", _check_plan(7.58)),
    # the 25 MiB default: the 1 MiB first bucket and the next 25 MiB go out before the embedding's gradient;
    # a bucket per parameter: all but the embedding's 0.375 MiB; one bucket after the first: the first's only
    Exercise(f"torchrun --nproc_per_node 2 train.py --dp-replicate 2 {OVERLAP}", _check_launched(26, 28)),
    Exercise(f"torchrun --nproc_per_node 2 train.py --dp-replicate 2 {OVERLAP} --bucket-mb 0",
             _check_launched(36.4, 36.4)),
    Exercise(f"torchrun --nproc_per_node 2 train.py --dp-replicate 2 {OVERLAP} --bucket-mb 1000",
             _check_launched(1.0, 2.5)),
    Exercise(f"torchrun --nproc_per_node 2 train.py --dp-replicate 2 {OVERLAP} --microbatches 4",
             _check_launched(26, 28)),
    Exercise("torchrun --nproc_per_node 2 train.py --dp-shard 2 --pad-share 0.6 --dtype float64 --check", _check_ok),
]
EXERCISES.append(Exercise(EXERCISES[-1].command, _check_mismatch, fails=True, edits=(
    ("train.py", "max(counted, 1) / (self.dp * self.cp * m)", "max(int((y != IGNORE).sum()), 1) / m"),)))
