"""HSDP (hsdp.py) on a 2 x 2 mesh: parity with one process, bytes on each mesh dimension
against the formulas, no all-gather across replicas, memory sharded over the shard group only."""

import numpy as np
import torch

from harness import run_ranks, run_script
from test_fsdp import B, CLIP, LR, S, STEPS, max_err, reference


def _run_hsdp():
    from hsdp import hsdp_train
    kw = dict(steps=STEPS, batch=B, seq=S, lr=LR)
    return dict(fp32=hsdp_train(2, 2, **kw), bf16=hsdp_train(2, 2, param_dtype=torch.bfloat16, **kw),
                clip=hsdp_train(2, 2, max_grad_norm=CLIP, **kw),
                keep=hsdp_train(2, 2, reshard_after_forward=False, **kw))


def test_hsdp_2x2():
    results = run_ranks(_run_hsdp, 4, timeout=300)
    ref, ref_mp = reference()[0], reference(compute_dtype=torch.bfloat16)[0]
    ref_clip, norms = reference(clip=CLIP)
    init = reference(steps=0)[0]
    for rank, res in enumerate(results):
        # parity: fp32 tight; bf16 relative to how far the parameters moved (see test_fsdp)
        assert max_err(res["fp32"]["state"], ref) < 1e-4
        assert max_err(res["keep"]["state"], ref) < 1e-4
        assert max_err(res["clip"]["state"], ref_clip) < 1e-4
        assert abs(res["clip"]["grad_norm"] - norms[-1]) < 1e-4 * norms[-1]
        err = sum(((torch.as_tensor(np.asarray(res["bf16"]["state"][k])) - ref_mp[k]) ** 2).sum() for k in ref)
        moved = sum(((ref_mp[k] - init[k]) ** 2).sum() for k in ref)
        assert (err / moved).sqrt() < 0.05

        # the mesh: shard groups {0,1}, {2,3}; replicate groups {0,2}, {1,3}
        fp = res["fp32"]
        assert fp["shard_ranks"] == ((0, 1) if rank < 2 else (2, 3))
        assert fp["replicate_ranks"] == ((0, 2) if rank % 2 == 0 else (1, 3))

        for key in ("fp32", "bf16", "keep"):
            r = res[key]
            # bytes on each dimension equal the formula, and nothing runs on any other group
            assert r["bytes_by_dim"]["dp_shard"] == r["bytes_formula"]["dp_shard"], key
            assert r["bytes_by_dim"]["dp_replicate"] == r["bytes_formula"]["dp_replicate"], key
            assert r["bytes_by_dim"]["other"] == {}, key
            # no all-gather (or reduce-scatter) crosses the replicate dimension
            for op, ranks, _ in r["events"]:
                if op in ("all_gather", "reduce_scatter"):
                    assert len(set(ranks) & set(r["replicate_ranks"])) == 1, (key, op, ranks)
            # only the reduced shard (1/S of the fp32 gradient) crosses replicas
            assert r["bytes_by_dim"]["dp_replicate"]["all_reduce"] == 4 * r["numel"] // 2
            # model state: (b_p + b_g + K) Ψ / S per rank, by category
            for cat, want in r["memory_formula"].items():
                got = r["memory"][cat]
                assert (got == 0) if want == 0 else abs(got - want) <= 0.05 * want, (key, cat, got, want)
        assert res["keep"]["bytes_by_dim"]["dp_shard"]["all_gather"] == 4 * res["keep"]["numel"]


def test_hsdp_torchrun_demo():
    out = run_script("hsdp.py", "--steps", "2", nproc=4)
    assert "-> ok" in out and "UNEXPECTED" not in out
    assert out.count("dp_replicate all_reduce") == 4


def test_hsdp_plain_python_demo():
    out = run_script("hsdp.py", "--steps", "2")  # a world of one: 1 x 1 mesh
    assert "-> ok" in out
