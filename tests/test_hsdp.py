"""HSDP (hsdp.py) on a 2 x 2 mesh: equal to one process, bytes on each mesh dimension equal to the
formulas, no all-gather across replicas, memory sharded over the shard group only. (The awkward
models run as HSDP too: tests/test_awkward_fsdp.py.)"""
import torch
import torch.distributed as dist

from lab.baseline import adamw_reach, max_diff
from harness import Exercise, run_script
from test_fsdp import B, CLIP, LR, S, STEPS, ranks, reference


def run():
    """On 4 ranks, inside test_fsdp.ranks(4)."""
    from hsdp import shard_hybrid
    from lab.hsdp_demo import hsdp_train
    from mesh import Mesh
    kw = dict(steps=STEPS, batch=B, seq=S, lr=LR)
    out = dict(fp64=hsdp_train(2, 2, dtype=torch.float64, **kw),
               bf16=hsdp_train(2, 2, param_dtype=torch.bfloat16, **kw),
               clip=hsdp_train(2, 2, max_grad_norm=CLIP, dtype=torch.float64, **kw),
               keep=hsdp_train(2, 2, reshard_after_forward=False, dtype=torch.float64, **kw),
               r4=hsdp_train(4, 1, dtype=torch.float64, **kw))
    # shard_hybrid, the lesson's own entry point, on the same mesh and data
    from lab.data import get_batch, load_corpus
    from lab.model import build_model
    model, tokens = build_model("tiny", seed=0, dtype=torch.float64), load_corpus()
    opt = shard_hybrid(model, Mesh(dp_replicate=2, dp_shard=2), lr=LR)
    for s in range(STEPS):
        model(*get_batch(tokens, s, B, S, 0, dist.get_rank(), 4)).backward()
        opt.step()
        opt.zero_grad()
    out["shard_hybrid"] = opt.full_state_dict()
    # PyTorch's FSDP2 HSDP with the same MixedPrecisionPolicy, for the bf16 run
    from lab.references import hsdp2
    theirs = build_model("tiny", seed=0)
    hsdp2(theirs, 2, 2, param_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(theirs.parameters(), lr=LR)
    for s in range(STEPS):
        theirs(*get_batch(tokens, s, B, S, 0, dist.get_rank(), 4)).backward()
        opt.step()
        opt.zero_grad()
    out["bf16_fsdp2"] = {n: p.full_tensor().detach() for n, p in theirs.named_parameters()}
    del theirs, opt  # FSDP2's state goes while the process group still exists
    errors = []  # bad input: one ValueError on every rank, before any collective
    for bad in (dict(mesh=Mesh(dp_replicate=2, dp_shard=2), stage=0), dict()):
        try:
            shard_hybrid(build_model("tiny"), **bad)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def test_hsdp_2x2():
    results = [r["hsdp"] for r in ranks(4)]
    ref64, (ref_clip, norms) = reference(torch.float64)[0], reference(torch.float64, clip=CLIP)
    ref_mp = reference(compute_dtype=torch.bfloat16)[0]
    for rank, res in enumerate(results):
        for key in ("fp64", "keep", "r4"):
            assert max_diff(res[key]["state"], ref64) < 1e-10, key
        assert max_diff(res["shard_hybrid"], ref64) < 1e-10
        assert len(res["errors"]) == 2 and "stage 1, 2 or 3" in res["errors"][0] and "Mesh" in res["errors"][1]
        assert max_diff(res["clip"]["state"], ref_clip) < 1e-10
        assert abs(res["clip"]["grad_norm"] - norms[-1]) < 1e-10
        # bf16: FSDP2's HSDP with the same casts makes the same sums in the same order (the same bits on any CPU:
        # measured 0 with ATEN_CPU_CAPABILITY default, avx2, avx512); one process with the same casts is only
        # within AdamW's reach (test_fsdp.test_mixed_precision_matches_same_casts, lab/baseline.py)
        assert max_diff(res["bf16"]["state"], res["bf16_fsdp2"]) < 1e-6
        assert max_diff(res["bf16"]["state"], ref_mp) < adamw_reach(LR, STEPS)

        # the mesh: shard groups {0,1}, {2,3}; replicate groups {0,2}, {1,3}
        assert res["fp64"]["shard_ranks"] == ((0, 1) if rank < 2 else (2, 3))
        assert res["fp64"]["replicate_ranks"] == ((0, 2) if rank % 2 == 0 else (1, 3))
        for key in ("fp64", "bf16", "keep", "r4"):
            r = res[key]
            # bytes on each dimension equal the formula, and nothing runs on any other group
            assert r["bytes_by_dim"]["dp_shard"] == r["bytes_formula"]["dp_shard"], key
            assert r["bytes_by_dim"]["dp_replicate"] == r["bytes_formula"]["dp_replicate"], key
            assert r["bytes_by_dim"]["other"] == {}, key
            for op, ranks_, _ in r["events"]:  # no all-gather or reduce-scatter crosses replicas
                if op in ("all_gather", "reduce_scatter"):
                    assert len(set(ranks_) & set(r["replicate_ranks"])) == 1, (key, op, ranks_)
            # model state: (b_p + b_g + K) Ψ / S per rank, by category (+ AdamW's step counters)
            for cat, want in r["memory_formula"].items():
                got = r["memory"][cat]
                assert (got == 0) if want == 0 else abs(got - want) <= 0.05 * want, (key, cat, got, want)
        # only the reduced shard (1/S of the float64 gradient) and the used-flags cross replicas
        fp = res["fp64"]
        assert fp["bytes_by_dim"]["dp_replicate"]["all_reduce"] == 8 * fp["numel"] // 2 + 4 * fp["n_params"]
        assert res["keep"]["bytes_by_dim"]["dp_shard"]["all_gather"] == 8 * res["keep"]["numel"]


def test_hsdp_torchrun_demo_compares_with_fsdp2():
    out = run_script("hsdp.py", "--steps", "2", "--compare", nproc=4)
    assert "-> ok" in out and "UNEXPECTED" not in out and "PyTorch FSDP2 HSDP" in out
    assert out.count("dp_replicate all_reduce") == 4


def test_hsdp_plain_python_demo():
    assert "-> ok" in run_script("hsdp.py", "--steps", "2")  # a world of one: 1 x 1 mesh


def test_bad_arguments_are_refused_before_any_work():
    out = run_script("hsdp.py", "--replicate", "3", nproc=2, expect_fail=True)
    assert "error: --replicate 3 must divide the 2 ranks" in out and "HSDP 3" not in out


def _bytes(out, dim, op):
    return [int(line.split("API bytes")[1].split("|")[0].replace(",", "")) for line in out.splitlines()
            if line.split()[:2] == [dim, op]]


def _check_2x2(out):
    rs, ar = _bytes(out, "dp_shard", "reduce_scatter"), _bytes(out, "dp_replicate", "all_reduce")
    flags = _bytes(out, "dp_shard", "all_reduce")
    assert len(rs) == len(ar) == 4 and all(a == r // 2 + f for a, r, f in zip(ar, rs, flags)), (rs, ar, flags)
    assert "shard group [0, 1], replicate group [0, 2]" in out


def _check_replicate_4(out):
    assert _bytes(out, "dp_replicate", "all_reduce") == [4 * 34_976 + 84] * 4  # the whole gradient, like DDP
    assert out.count("total 559,") == 4  # 16 bytes per parameter: nothing sharded


def _check_replicate_1(out):
    assert _bytes(out, "dp_replicate", "all_reduce") == [] and out.count("total 139,") == 4  # 4 bytes/param


def _check_bf16(out):
    assert _bytes(out, "dp_shard", "all_gather") == [139_904] * 4  # bf16 parameters: half of 279,808 (b_p·2Ψ)
    assert _bytes(out, "dp_replicate", "all_reduce") == [70_036] * 4  # fp32 gradient shards, as without --bf16


EXERCISES = [
    Exercise("torchrun --nproc_per_node 4 hsdp.py", _check_2x2),
    Exercise("torchrun --nproc_per_node 4 hsdp.py --replicate 4", _check_replicate_4),
    Exercise("torchrun --nproc_per_node 4 hsdp.py --replicate 1", _check_replicate_1),
    Exercise("torchrun --nproc_per_node 4 hsdp.py --bf16", _check_bf16),
]
