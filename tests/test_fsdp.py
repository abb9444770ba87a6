"""ZeRO stages 0-3 (fsdp.py) against the single-process run, the ZeRO formulas and PyTorch's FSDP2.

One spawned group per world size (`ranks(P)`, shared with test_awkward_fsdp.py and test_hsdp.py) runs
every configuration of the three modules and returns what it measured; the tests assert on that.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab.baseline import adamw_reach, max_diff, single_process
from harness import Exercise, global_batches, reference_model, run_ranks, run_script
from lab.instruments import CommCounter
from lab.fsdp_demo import held_bytes

STEPS, B, S, LR = 3, 8, 16, 1e-2
CLIP = 0.05  # well below the gradient norm of the first steps, so clipping really scales


@functools.cache
def ranks(P):
    """Every configuration of test_fsdp, test_awkward_fsdp and (P = 4) test_hsdp, on P gloo ranks."""
    return run_ranks(_on_ranks, P, timeout=600)


def _on_ranks():
    import test_awkward_fsdp
    import test_hsdp
    P = dist.get_world_size()
    return dict(fsdp=(_run_p2 if P == 2 else _run_p4)(), awkward=test_awkward_fsdp.run(),
                hsdp=test_hsdp.run() if P == 4 else None)


@functools.cache
def reference(dtype=torch.float32, steps=STEPS, **kw):
    """lab.baseline.single_process on the whole global batches: the parameters by name (and the clip norms)."""
    out = single_process(reference_model(dtype=dtype), global_batches(steps, B, S), lr=LR, **kw)
    return out["model"].state_dict(), out["norms"]


# ---- what the ranks run ----------------------------------------------------------------------------

def _loop(model, opt, steps=STEPS, dtype=None):
    from lab.data import get_batch, load_corpus
    tokens, r, P = load_corpus(), dist.get_rank(), dist.get_world_size()
    for s in range(steps):
        model(*get_batch(tokens, s, B, S, 0, r, P)).backward()
        opt.step()
        opt.zero_grad()


def _fsdp2_state(param_dtype=None):
    """PyTorch's FSDP2 fully_shard (each Block, then the root) on the same model and data."""
    from lab.model import build_model
    from lab.references import fsdp2
    model = build_model("tiny", seed=0)
    fsdp2(model, param_dtype=param_dtype)
    _loop(model, torch.optim.AdamW(model.parameters(), lr=LR))
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def _mlp_and_data():
    """A model that is not the course's Transformer, and its global batches (float64)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    gen = torch.Generator().manual_seed(1)
    return net, [(torch.randn(B, 8, generator=gen, dtype=torch.float64), torch.randn(B, 3, generator=gen,
                                                                                    dtype=torch.float64))
                 for _ in range(STEPS)]


def _mse(net, batch):
    return F.mse_loss(net(batch[0]), batch[1])


def _checkpoint(stage, **kw):
    """Train 2 steps, save this rank's shards; a model built from another seed (and gathered by an
    evaluation) loads them; one more step on each must agree to the bit."""
    from lab.data import get_batch, load_corpus
    from fsdp import Seams, shard_model
    from lab.model import build_model
    tokens, r, P = load_corpus(), dist.get_rank(), dist.get_world_size()

    def step(model, opt, s):
        model(*get_batch(tokens, s, B, S, 0, r, P)).backward()
        opt.step()
        opt.zero_grad()
    a = build_model("tiny", seed=0)
    oa = shard_model(a, stage, lr=LR, **kw)
    for s in range(2):
        step(a, oa, s)
    saved = oa.shard_state_dict()
    step(a, oa, 2)
    b = build_model("tiny", seed=1)
    ob = shard_model(b, stage, lr=LR, **kw)
    with torch.no_grad():
        b(get_batch(tokens, 0, B, S, 0)[0])
    ob.load_shard_state_dict(saved)
    step(b, ob, 2)
    return max_diff(oa.full_state_dict(), ob.full_state_dict())


def _run_p2():
    """Everything measured on 2 ranks."""
    from fsdp import Seams, shard_model
    from lab.fsdp_demo import train_and_measure
    from lab.model import Attention, SwiGLU, build_model
    kw = dict(steps=STEPS, batch=B, seq=S, lr=LR)
    out = {f"stage{s}": train_and_measure(s, **kw) for s in range(4)}  # fp32: bytes and memory (16, 12, 10, 8)
    out["stage3_keep"] = train_and_measure(3, reshard_after_forward=False, **kw)
    # Equal to one process is checked in float64 (lab/baseline.py: fp32 after AdamW only within AdamW's reach)
    kw64 = dict(kw, dtype=torch.float64)
    out["fp64"] = {f"stage{s}": train_and_measure(s, **kw64)["state"] for s in range(4)}
    out["fp64"].update(stage3_keep=train_and_measure(3, reshard_after_forward=False, **kw64)["state"],
                       stage3_noprefetch=train_and_measure(3, prefetch=False, **kw64)["state"],
                       stage3_by_class=train_and_measure(3, units=(Attention, SwiGLU), **kw64)["state"])
    for s in range(4):
        out[f"clip{s}"] = train_and_measure(s, max_grad_norm=CLIP, **kw64)
        out[f"bf16_{s}"] = train_and_measure(s, param_dtype=torch.bfloat16, **kw)
    out["meta3"] = train_and_measure(3, meta=True, steps=1, lr=0.0)
    out["eager3"] = train_and_measure(3, steps=1, lr=0.0)
    out["fsdp2"], out["fsdp2_bf16"] = _fsdp2_state(), _fsdp2_state(torch.bfloat16)

    # Stage 1 with any torch.optim class (its state is sharded: one piece per parameter)
    model = build_model("tiny", seed=0)
    opt = shard_model(model, 1, torch.optim.SGD, lr=LR, momentum=0.9)
    _loop(model, opt)
    out["sgd1"] = opt.full_state_dict()
    # Units as an explicit list of submodules.
    model = build_model("tiny", seed=0, dtype=torch.float64)
    opt = shard_model(model, 3, units=[model.layers[0].attn, model.layers[1]], lr=LR)
    _loop(model, opt)
    out["explicit_units"] = opt.full_state_dict()
    # Any nn.Module: units chosen by class (each Linear a unit; the Sequential has no root parameters).
    for stage in (2, 3):
        net, batches = _mlp_and_data()
        opt = shard_model(net, stage, units=(torch.nn.Linear,), lr=LR)
        for batch in batches:
            _mse(net, [t.chunk(2)[dist.get_rank()] for t in batch]).backward()
            opt.step()
            opt.zero_grad()
        out[f"mlp{stage}"] = opt.full_state_dict()

    # Full state dict round trip: load rank 0's dict into a model sharded from another seed.
    for stage in (1, 3):
        saved = shard_model(build_model("tiny", seed=0), stage, lr=LR).full_state_dict()
        dst = shard_model(build_model("tiny", seed=1), stage, lr=LR)
        before = max_diff(dst.full_state_dict(), saved)
        dst.load_full_state_dict(saved)
        out[f"roundtrip{stage}"] = (before, max_diff(dst.full_state_dict(), saved))
    out["checkpoint"] = {f"{s}{'_keep' * (not rs)}": _checkpoint(s, reshard_after_forward=rs)
                         for s, rs in ((1, True), (2, True), (3, True), (3, False))}
    out["accumulate"] = {(s, m, rs): train_and_measure(s, microbatches=m, reshard_after_forward=rs, dtype=torch.float64,
                                                       steps=STEPS, batch=B, seq=S, lr=LR)
                         for s, rs in ((1, True), (2, True), (3, True), (3, False)) for m in (1, 2, 4)}

    # Bad input: one ValueError on every rank, before any collective.
    errors = []
    with CommCounter() as c:
        for bad in (dict(stage=4), dict(stage=0, seams=Seams(after_reduce=lambda t: None)),
                    dict(stage=3, param_dtype=torch.int64), dict(stage=3, units=[torch.nn.Linear(2, 2)]),
                    dict(stage=1, seams=Seams(groups_of=lambda n, p: (dist.group.WORLD, 0))),
                    dict(stage=2, seams=Seams(groups_of=lambda n, p: "experts"))):
            try:
                shard_model(build_model("tiny"), **bad)
            except ValueError as e:
                errors.append(str(e))
        try:
            shard_model(build_model("tiny", device="meta"), 3)
        except ValueError as e:
            errors.append(str(e))
    out["errors"], out["error_calls"] = errors, c.calls()
    return out


def _experts(stage, clip=False, clip_group=None):
    """Issue 14: a mixture of experts with ep = 2 on 4 ranks (dp = 4, edp = 2). Dense parameters are
    sharded over the 4 ranks, each rank's experts over the 2 ranks holding the same ones (edp); the
    all-to-all already summed expert gradients over the ep group, so both divide by dp = 4."""
    from lab.data import get_batch, load_corpus
    from expert_parallel import parallelize_experts
    from fsdp import Seams, shard_model
    from mesh import Mesh
    from lab.model import build_model, get_config
    P, r = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(dp_shard=P, ep=2)
    model = parallelize_experts(build_model(get_config("tiny", n_experts=4), seed=0, dtype=torch.float64), mesh)
    expert = {id(p) for blk in model.layers for p in blk.mlp.expert_parameters()}
    opt = shard_model(model, stage, lr=LR,
                      seams=Seams(groups_of=lambda n, p: (mesh.group("edp"), P) if id(p) in expert else None))
    tokens = load_corpus()
    for s in range(STEPS):
        with CommCounter() as c:
            model(*get_batch(tokens, s, B, S, 0, r, P)).backward()
            if clip:
                opt.clip_grad_norm_(CLIP, group=clip_group)
            opt.step()
        if s < STEPS - 1:
            opt.zero_grad()
    groups = {}
    for u in opt.units:
        g = groups.setdefault(tuple(dist.get_process_group_ranks(u.group)), dict(units=[]))
        g["units"].append(u)
    for ranks_, g in groups.items():  # per group: sizes, bytes of the last step, state at rest
        us = g.pop("units")
        g.update(numel=sum(u.flat_numel for u in us), k=sum(len(u.params) for u in us), P=len(ranks_),
                 root=sum(u.flat_numel for u in us if u.root),
                 comm={e.op: 0 for e in c.events if e.group_ranks == ranks_},
                 memory=held_bytes(opt, us))
        for e in c.events:
            if e.group_ranks == ranks_:
                g["comm"][e.op] += e.api_bytes
    opt.zero_grad()
    first = model.layers[0].mlp.first
    return dict(state=opt.full_state_dict(), groups=groups, first=first, n_local=model.layers[0].mlp.n_local,
                norm=None if opt.grad_norm is None else opt.grad_norm.item())


def _tp_partial(stage, hook=True):
    """Issue 14: gradients that must be summed over another group before the reduction. 4 ranks as
    dp 2 x "tp" 2: both tp ranks hold the whole model and the same rows, but each takes the loss of
    half the positions, so each holds a partial gradient; before_reduce sums them over tp."""
    from lab.data import get_batch, load_corpus
    from fsdp import Seams, shard_model
    from mesh import Mesh, all_reduce_flat
    from lab.model import build_model
    mesh = Mesh(dp_shard=2, tp=2)
    tp, d, t = mesh.group("tp"), mesh.rank("dp_shard"), mesh.rank("tp")
    model = build_model("tiny", seed=0, dtype=torch.float64)
    opt = shard_model(model, stage, group=mesh.group("dp_shard"), lr=LR, seams=Seams(
                      before_reduce=(lambda ps: all_reduce_flat([p.grad for p in ps if p.grad is not None], tp))
                      if hook else None))
    tokens = load_corpus()
    for s in range(STEPS):
        x, y = get_batch(tokens, s, B, S, 0, d, 2)
        half = slice(t * S // 2, (t + 1) * S // 2)
        logits = model(x)[:, half]
        F.cross_entropy(logits.flatten(0, 1), y[:, half].flatten(), reduction="sum").div(y.numel()).backward()
        opt.step()
        opt.zero_grad()
    return opt.full_state_dict()


def _clip_over_world(stage):
    """HSDP 2 x 2 with clipping over the whole world: each element is held by 2 replicas (weight 1/2)."""
    from lab.data import get_batch, load_corpus
    from hsdp import shard_hybrid
    from mesh import Mesh
    from lab.model import build_model
    mesh, r, P = Mesh(dp_replicate=2, dp_shard=2), dist.get_rank(), dist.get_world_size()
    model, tokens = build_model("tiny", seed=0, dtype=torch.float64), load_corpus()
    opt = shard_hybrid(model, mesh, stage=stage, lr=LR)
    norms = []
    for s in range(STEPS):
        model(*get_batch(tokens, s, B, S, 0, r, P)).backward()
        norms.append(opt.clip_grad_norm_(CLIP, group=dist.group.WORLD, weight_of=lambda name: 0.5).item())
        opt.step()
        opt.zero_grad()
    return dict(state=opt.full_state_dict(), norms=norms)


def _run_p4():
    from lab.fsdp_demo import train_and_measure
    kw = dict(steps=STEPS, batch=B, seq=S, lr=LR, dtype=torch.float64)
    out = {f"fp64_{s}": train_and_measure(s, **kw) for s in range(4)}
    out["bf16_3"] = train_and_measure(3, param_dtype=torch.bfloat16, steps=1, batch=B, seq=S, lr=LR)
    out["experts"] = {s: _experts(s) for s in range(4)}
    out["experts_clip"] = {g: _experts(3, clip=True, clip_group=dist.group.WORLD if g == "world" else None)
                           for g in ("world", "default")}
    out["tp"] = {s: _tp_partial(s) for s in range(4)}
    out["tp_without_hook"] = _tp_partial(2, hook=False)
    out["clip_world"] = {s: _clip_over_world(s) for s in (1, 3)}
    return out


@pytest.fixture(scope="module")
def p2():
    return [r["fsdp"] for r in ranks(2)]


@pytest.fixture(scope="module")
def p4():
    return [r["fsdp"] for r in ranks(4)]



def _err(state, ref):
    return max_diff(state, ref)


# ---- parity with one process -----------------------------------------------------------------------

def test_every_stage_equals_single_process(p2, p4):
    """float64: equal to rounding (AdamW would turn fp32 rounding on a ~0 gradient into whole steps, CPU by CPU);
    the fp32 runs only within AdamW's reach (lab/baseline.py); SGD in fp32 to 1e-6, since its update lr·(momentum
    of the gradients) is not normalised: a rounding-level gradient difference stays rounding-level (~1e-10 here)."""
    ref, ref64 = reference()[0], reference(torch.float64)[0]
    for r, rank_out in enumerate(p2):  # full_state_dict gathers the whole model on every rank
        for key, state in rank_out["fp64"].items():
            assert _err(state, ref64) < 1e-10, (r, key)
        for s in range(4):
            assert _err(rank_out[f"stage{s}"]["state"], ref) < adamw_reach(LR, STEPS), (r, s)
    sgd = single_process(reference_model(), global_batches(STEPS, B, S), lr=LR, optimizer=torch.optim.SGD, momentum=0.9)
    for r, rank_out in enumerate(p2):
        assert _err(rank_out["sgd1"], sgd["model"].state_dict()) < 1e-6, r
        assert _err(rank_out["explicit_units"], ref64) < 1e-10, r
    for rank_out in p4:  # float64: only the order of additions differs
        for s in range(4):
            assert _err(rank_out[f"fp64_{s}"]["state"], ref64) < 1e-10, s
            assert max(abs(a - b) for a, b in zip(rank_out[f"fp64_{s}"]["losses"], reference_losses())) < 1e-10
    assert _err(p2[0]["stage3"]["state"], reference(steps=0)[0]) > 1e-2  # it really trained


@functools.cache
def reference_losses():
    return single_process(reference_model(dtype=torch.float64), global_batches(STEPS, B, S), lr=LR)["losses"]


def test_any_module_with_units_by_class(p2):
    net, batches = _mlp_and_data()
    ref = single_process(net, batches, lr=LR, loss_fn=_mse)["model"].state_dict()
    for r, rank_out in enumerate(p2):
        for stage in (2, 3):
            assert _err(rank_out[f"mlp{stage}"], ref) < 1e-10, (r, stage)  # float64
    assert _err(p2[0]["mlp3"], net.state_dict()) > 1e-3


def test_gradient_clipping_by_global_norm(p2):
    ref_clip, norms = reference(torch.float64, clip=CLIP)
    assert max(norms) > 2 * CLIP  # clipping is active
    for r, rank_out in enumerate(p2):  # the norm is all-reduced: every rank clips by the same factor (float64)
        for s in range(4):
            out = rank_out[f"clip{s}"]
            assert _err(out["state"], ref_clip) < 1e-10, (r, s)
            assert abs(out["grad_norm"] - norms[-1]) < 1e-10 * norms[-1], (r, s)


def test_mixed_precision_matches_same_casts(p2, p4):
    """bf16 compute copy; fp32 master, optimizer state and gradient reduction. Every stage equals FSDP2 with the
    same MixedPrecisionPolicy: the same casts and the same sums in the same order (two ranks: a + b, halved
    exactly), so the same bits on any CPU (measured 0 with ATEN_CPU_CAPABILITY default, avx2 and avx512).
    Against one process with the same casts only AdamW's reach holds: bf16 rounds activations differently for a
    4-row local batch than for the 8-row global batch, and AdamW turns that into whole steps where a gradient is
    ~0 (lab/baseline.py; measured 1.3e-2 to 1.7e-2 of 6.0e-2)."""
    ref_mp = reference(compute_dtype=torch.bfloat16)[0]
    for r, rank_out in enumerate(p2):
        for s in range(4):
            state = rank_out[f"bf16_{s}"]["state"]
            assert _err(state, rank_out["fsdp2_bf16"]) < 1e-6, (r, s)
            assert _err(state, ref_mp) < adamw_reach(LR, STEPS), (r, s)
        assert _err(rank_out["bf16_3"]["state"], rank_out["stage3"]["state"]) > 1e-3, r  # the casts really happen


def test_stage3_equals_fsdp2_fully_shard(p2):
    for r in range(2):  # fp32: the same sums in the same order, so the same bits on any CPU (see above)
        assert _err(p2[r]["stage3"]["state"], p2[r]["fsdp2"]) < 1e-6


# ---- bytes and memory against the formulas ------------------------------------------------------------

def test_bytes_per_step_equal_the_formulas(p2, p4):
    for results, P, keys in ((p2, 2, ("stage0", "stage1", "stage2", "stage3", "stage3_keep", "bf16_0",
                                      "bf16_1", "bf16_2", "bf16_3")),
                             (p4, 4, ("fp64_0", "fp64_1", "fp64_2", "fp64_3", "bf16_3"))):
        for r, out_by_key in enumerate(results):  # each rank counted its own calls
            for key in keys:
                out = out_by_key[key]
                got = {op: s["bytes"] for op, s in out["comm"].items()}
                assert got == out["comm_formula"], (P, r, key, got, out["comm_formula"])
                # ZeRO §7 in ring bytes per rank: 2Ψ for stages 0-2, 3Ψ for stage 3 (+ the used-flags)
                psi, pb, gb, stage = out["numel"], out["param_bytes"], 8 if "fp64" in key else 4, out["stage"]
                gathers = (2 * psi - out["root_numel"]) if stage == 3 and key != "stage3_keep" else psi
                want = {0: 2 * gb * psi, 1: (gb + pb) * psi, 2: (gb + pb) * psi, 3: gb * psi + pb * gathers}[stage]
                flags = 2 * 4 * out["n_params"]
                assert sum(s["wire_bytes"] for s in out["comm"].values()) == \
                    pytest.approx((want + flags) * (P - 1) / P), (P, r, key)
    for r, out_by_key in enumerate(p2):
        s3, keep = out_by_key["stage3"], out_by_key["stage3_keep"]
        assert keep["comm"]["all_gather"]["bytes"] == 4 * keep["numel"], r  # no re-gather: b_p Ψ in all
        # 4 units (embedding, 2 blocks, norm + head), each gathered for forward and again for backward; the
        # course's model leaves no parameter to the root unit, which alone would stay gathered into backward
        assert s3["root_numel"] == 0 and s3["comm"]["all_gather"]["calls"] == 2 * 4, r


def test_model_state_bytes_by_category_match_zero_formulas(p2, p4):
    for results, keys in ((p2, ("stage0", "stage1", "stage2", "stage3", "bf16_0", "bf16_1", "bf16_2", "bf16_3")),
                          (p4, ("fp64_0", "fp64_1", "fp64_2", "fp64_3"))):
        for out in results:
            for key in keys:
                mem, form = out[key]["memory"], out[key]["memory_formula"]
                for cat in ("parameters", "master", "gradients", "optimizer", "total"):
                    # AdamW adds one step counter per piece (a few bytes): within 5%
                    assert (mem[cat] == 0) if form[cat] == 0 else abs(mem[cat] - form[cat]) <= 0.05 * form[cat], \
                        (key, cat, mem[cat], form[cat])
    for r, out in enumerate(p2):  # the headline: bytes per parameter 16 -> 12 -> 10 -> 8 at P = 2 (fp32 Adam)
        psi = out["stage0"]["numel"]
        assert [round(out[f"stage{s}"]["memory"]["total"] / psi) for s in range(4)] == [16, 12, 10, 8], r


def test_meta_init_materialises_only_the_shard(p2):
    for r in range(2):
        meta, eager = p2[r]["meta3"], p2[r]["eager3"]
        assert max_diff(meta["state"], eager["state"]) == 0 and meta["memory"] == eager["memory"]
        assert meta["memory"]["parameters"] == 4 * meta["numel"] // 2


def test_full_state_dict_round_trip(p2):
    for r in range(2):
        for stage in (1, 3):
            before, after = p2[r][f"roundtrip{stage}"]
            assert before > 1e-3 and after == 0


def test_bad_input_raises_before_any_collective(p2):
    for r in range(2):
        errs = p2[r]["errors"]
        assert len(errs) == 7 and p2[r]["error_calls"] == 0
        assert "stage must be 0, 1, 2 or 3" in errs[0] and "replicate_group" in errs[1]
        assert "param_dtype" in errs[2] and "submodules" in errs[3] and "init_fn" in errs[6]
        assert all("groups_of" in e for e in errs[4:6])


# ---- what train.py needs (issue 14) ------------------------------------------------------------------

def test_shard_checkpoint_continues_exactly(p2):
    for r in range(2):
        assert p2[r]["checkpoint"] == {k: 0.0 for k in ("1", "2", "3", "3_keep")}


def test_accumulating_reduces_once_per_step(p2):
    """m micro-batches inside opt.accumulating(): equal to one process in float64, and one
    reduce-scatter 4Ψ per step whatever m; stage 3 without resharding gathers b_p Ψ once."""
    ref64 = reference(torch.float64)[0]
    for r, rank_out in enumerate(p2):
        for (stage, m, rs), out in rank_out["accumulate"].items():
            assert _err(out["state"], ref64) < 1e-10 and max(abs(a - b) for a, b in zip(
                out["losses"], reference_losses())) < 1e-10, (r, stage, m, rs)
            got = {op: s["bytes"] for op, s in out["comm"].items()}
            assert got == out["comm_formula"], (r, stage, m, rs, got, out["comm_formula"])
            assert got["reduce_scatter"] == 8 * out["numel"], r  # once per step, whatever m
            if stage != 3 or not rs:
                assert got["all_gather"] == 8 * out["numel"], r  # once per step, whatever m
            else:
                assert got["all_gather"] == m * 8 * (2 * out["numel"] - out["root_numel"]), r


def test_experts_sharded_over_their_own_group(p4):
    """groups_of: expert weights in flat buffers of their own over edp (2 ranks), dense over dp (4);
    float64 equal to one process at every stage; per group, bytes and state equal the formulas."""
    from lab.fsdp_demo import zero_comm_formula, zero_state_formula
    from lab.model import build_model, get_config
    cfg = get_config("tiny", n_experts=4)
    ref = single_process(build_model(cfg, seed=0, dtype=torch.float64), global_batches(STEPS, B, S), lr=LR)
    ref_state = ref["model"].state_dict()
    for stage in range(4):
        for r, res in enumerate(p4):
            out = res["experts"][stage]
            lo, n = out["first"], out["n_local"]
            mine = {k: v[lo:lo + n] if k.endswith((".w1", ".w2", ".w3")) else v for k, v in ref_state.items()}
            assert _err(out["state"], mine) < 1e-10, (stage, r)
            for ranks_, g in out["groups"].items():
                want = zero_comm_formula(stage, g["numel"], g["P"], 8, g["root"], n_params=g["k"], grad_bytes=8)
                got = dict(g["comm"])
                if g["P"] == 4:  # the MoE's own aux-loss all-reduce ([2E + 1] per layer) runs on dp too
                    got["all_reduce"] -= cfg.n_layers * (2 * cfg.n_experts + 1) * 8
                assert {k: v for k, v in got.items() if v and k != "all_to_all"} == want, (stage, ranks_, got, want)
                form = zero_state_formula(stage, g["numel"], g["P"], 8, 0, 8, 16)
                for cat in ("parameters", "gradients", "optimizer"):
                    assert abs(g["memory"][cat] - form[cat]) <= 0.05 * form[cat] + 64, (stage, ranks_, cat)


def test_clip_norm_over_the_ranks_that_hold_every_parameter(p4):
    """clip_grad_norm_(max_norm, group, weight_of): the norm of the whole model, as torch computes it."""
    ref_state, norms = reference(torch.float64, clip=CLIP)
    for r, rank_out in enumerate(p4):
        for s in (1, 3):
            out = rank_out["clip_world"][s]
            assert max(abs(a - b) for a, b in zip(out["norms"], norms)) < 1e-10 * norms[0], (r, s)
            assert _err(out["state"], ref_state) < 1e-10, (r, s)
    # experts: over the world every element is held once; over each unit's own group (the default)
    # the experts of the other ep rank are missing from the norm
    from lab.model import build_model, get_config
    ref = single_process(build_model(get_config("tiny", n_experts=4), seed=0, dtype=torch.float64),
                         global_batches(STEPS, B, S), lr=LR, clip=CLIP)
    for r, rank_out in enumerate(p4):
        assert abs(rank_out["experts_clip"]["world"]["norm"] - ref["norms"][-1]) < 1e-10, r
        assert abs(rank_out["experts_clip"]["default"]["norm"] - ref["norms"][-1]) > 1e-6, r


def test_before_reduce_sums_partial_gradients_first(p4):
    ref64 = reference(torch.float64)[0]
    for r in range(4):
        for s in range(4):
            assert _err(p4[r]["tp"][s], ref64) < 1e-10, (r, s)
    for r in range(4):  # without the hook every rank steps on a partial gradient
        assert _err(p4[r]["tp_without_hook"], ref64) > 1e-4, r


# ---- the demos and the README's exercises ------------------------------------------------------------

def test_torchrun_demo_compares_with_fsdp2():
    out = run_script("fsdp.py", "--stage", "3", "--steps", "3", "--compare", nproc=2)
    assert "-> ok" in out and "PyTorch FSDP2 fully_shard" in out and "MISMATCH" not in out
    assert out.count("reduce_scatter") == 2  # one table per rank


def test_plain_python_demo():
    out = run_script("fsdp.py", "--stage", "2", "--steps", "3", "--param-dtype", "bf16", "--peak")
    assert "-> ok" in out and "gradients" in out and "MemTracker peak" in out


def test_bad_arguments_are_refused_before_any_work():
    out = run_script("fsdp.py", "--batch", "7", nproc=2, expect_fail=True)
    assert "error: --batch 7 must be a multiple of the 2 ranks" in out and "ZeRO stage" not in out


def _lines(out, word):
    return [line for line in out.splitlines() if line.strip().startswith(word)]


def _check_stage1(out):
    assert out.count("(10.00 bytes per parameter)") == 4  # (4 + 4)Ψ + 8Ψ/4 on every rank
    assert all(" 139,904 |     139,904" in line for line in _lines(out, "all_gather")), _lines(out, "all_gather")


def _check_no_reshard(out):
    gathers = _lines(out, "all_gather")
    assert len(gathers) == 2 and all("139,904 |     139,904" in g and "(4 calls)" in g for g in gathers), gathers


def _check_bf16_compare(out):
    assert all(" 139,904 |" in line for line in _lines(out, "all_gather"))  # bf16: half of fp32's 279,808 (2Ψ)
    assert all(" 139,904 |" in line for line in _lines(out, "reduce_scatter"))  # fp32 gradients
    assert len([m for m in _lines(out, "master") if not m.split()[1].startswith("0.0000")]) == 4
    assert "PyTorch FSDP2 fully_shard: max |diff| to ours = 0.00e+00" in out and "-> ok" in out


def _check_stages(out):
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "2 ", "3 "))}
    assert [rows[n][3] for n in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")] == ["16.00", "7.00", "4.00"], rows
    assert all(float(r[-1]) == 0.0 for r in rows.values()) and out.count("-> ok") == 3, out


EXERCISES = [
    Exercise("torchrun --nproc_per_node 4 fsdp.py --stage 1", _check_stage1),
    Exercise("torchrun --nproc_per_node 2 fsdp.py --stage 3 --no-reshard", _check_no_reshard),
    Exercise("torchrun --nproc_per_node 4 fsdp.py --stage 3 --param-dtype bf16 --compare", _check_bf16_compare),
    Exercise("torchrun --nproc_per_node 4 fsdp.py --stages 0 2 3 --model tiny --steps 2 --batch 4 --seq 16",
             _check_stages),
]


# ---- ZeRO-1 over any parameters (fsdp.shard_optimizer) ----------------------------------------------------

def _tied_frozen_model():
    from lab.model import build_model
    model = build_model("tiny", seed=0, dtype=torch.float64)
    model.output.weight = model.tok_embeddings.weight      # tied: one parameter, used twice
    model.layers[0].attn_norm.weight.requires_grad_(False)  # frozen
    return model


def _groups(model):
    """Two parameter groups with their own settings (and the tied weight listed in both: it counts once)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    return [dict(params=decay, weight_decay=0.1), dict(params=[p for p in model.parameters()] + decay,
                                                         weight_decay=0.0, lr=2 * LR)]


def _zero1_over_parameters():
    from lab.data import get_batch, load_corpus
    from fsdp import shard_optimizer
    P, r = dist.get_world_size(), dist.get_rank()
    model = _tied_frozen_model()
    ids = [id(p) for p in model.parameters()]
    opt = shard_optimizer(_groups(model), torch.optim.AdamW, lr=LR)
    assert [id(p) for p in model.parameters()] == ids  # every parameter kept its identity
    tokens = load_corpus()
    for s in range(STEPS):
        model(*get_batch(tokens, s, B, S, 0, r, P)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_zero1_over_any_parameters_equals_the_unsharded_optimizer():
    """shard_optimizer(param_groups, AdamW) on 2 ranks — a tied weight, a frozen one, two groups with their own
    weight decay and learning rate — against torch.optim.AdamW with the same groups on the whole global batch
    in one process (float64)."""
    from lab.data import get_batch, load_corpus
    results = run_ranks(_zero1_over_parameters, 2, timeout=120)
    model = _tied_frozen_model()
    seen, groups = set(), []
    for g in _groups(model):  # torch's optimizer refuses a parameter in two groups: keep its first
        groups.append(dict(g, params=[p for p in g["params"] if p.requires_grad and id(p) not in seen
                                      and not seen.add(id(p))]))
    opt, tokens = torch.optim.AdamW(groups, lr=LR), load_corpus()
    frozen = model.layers[0].attn_norm.weight.detach().clone()
    for s in range(STEPS):
        model(*get_batch(tokens, s, B, S)).backward()
        opt.step()
        opt.zero_grad()
    want = {n: p.detach() for n, p in model.named_parameters()}
    for got in results:
        assert max_diff(got, want) < 1e-12
        assert torch.equal(got["layers.0.attn_norm.weight"], frozen)


# ---- the core (fsdp.py section 1): FlatParameter, zero_step, gather_when_used — ZeRO as the paper states it ----

def _core_units(model):
    return [model.tok_embeddings, *model.layers, model.norm, model.output]


def core_run(stage: int, steps: int = STEPS) -> dict:
    """The core alone on the float64 tiny model, one FlatParameter per module (embedding, each block, norm,
    head), AdamW over the shards; stage 3 also gathers each module only while it runs. Returns the parameters
    after the steps, the last step's bytes by collective, and what the flat buffers hold at rest."""
    from fsdp import FlatParameter, gather_when_used, zero_step
    from lab.data import get_batch, load_corpus
    from lab.instruments import CommCounter
    from lab.model import build_model
    tokens, r, P = load_corpus(), dist.get_rank(), dist.get_world_size()
    model = build_model("tiny", seed=0, dtype=torch.float64)
    flats = [FlatParameter(m.parameters()) for m in _core_units(model)]
    opt = torch.optim.AdamW([f.shard for f in flats], lr=LR)
    if stage == 3:
        for m, f in zip(_core_units(model), flats):
            gather_when_used(m, f)
            f.free()
    for s in range(steps):
        with CommCounter() as comm:
            model(*get_batch(tokens, s, B, S, 0, r, P)).backward()
            zero_step(flats, opt)
    at_rest = sum(f.buf.untyped_storage().nbytes() for f in flats)
    for f in flats:
        if stage == 3:
            f.unshard()
    return dict(state={k: v.clone() for k, v in model.state_dict().items()}, comm=comm.summary(), at_rest=at_rest,
                psi=sum(f.flat_numel for f in flats), shards=sum(f.shard.numel() for f in flats))


def _core_all():
    return {s: core_run(s) for s in (2, 3)}


@functools.cache
def core_results(P):
    return run_ranks(_core_all, P, timeout=120)


@pytest.mark.parametrize("P", [1, 2, 4])
def test_the_core_equals_one_process_and_moves_the_papers_bytes(P):
    """zero_step (reduce-scatter, step my slice, all-gather) and stage 3's gather before each use and free after,
    in float64 against one process on every rank; per step the reduce-scatter hands over 8Ψ bytes (Ψ padded), the
    all-gather 8Ψ after the step (stage 2) or 2·8Ψ before the forwards and backwards (stage 3), whose buffers
    hold no bytes at rest."""
    want = reference(torch.float64)[0]
    for rank, res in enumerate(core_results(P)):
        for stage in (2, 3):
            got = res[stage]
            assert max_diff(got["state"], want) < 1e-10, (P, rank, stage, max_diff(got["state"], want))
            assert got["shards"] * P == got["psi"], (P, rank, stage)
            if P > 1:
                rs, ag = got["comm"]["reduce_scatter"]["bytes"], got["comm"]["all_gather"]["bytes"]
                assert rs == 8 * got["psi"] and ag == 8 * got["psi"] * (2 if stage == 3 else 1), (P, rank, stage, rs, ag)
            assert got["at_rest"] == (0 if stage == 3 else 8 * got["psi"]), (P, rank, stage, got["at_rest"])
