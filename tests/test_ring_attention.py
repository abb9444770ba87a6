"""Context parallel: ring attention (contiguous, zigzag) and Ulysses equal full-sequence SDPA,
send the bytes the formula says, balance causal work, and train the shared model like one process."""

import pytest
import torch
import torch.distributed as dist

from harness import global_batches, reference_model, run_ranks, run_script, train_reference
from instruments import CommCounter
from mesh import Mesh
from ring_attention import (LAYOUTS, ContextParallelAttention, attention_case, chunk_ids, full_attention,
                            gather_sequence, run_cases, shard_positions, shard_sequence, train_cp)

B, S, H, HKV, D = 2, 32, 4, 2, 8


def _cases(cp):
    cases = [dict(method=m, layout=l, causal=c, dtype=torch.float64)
             for m in ("ring", "ulysses") for l in ("contiguous", "zigzag") for c in (True, False)]
    cases += [dict(method="ring", layout="zigzag", causal=True, dtype=torch.float32),
              dict(method="ring", layout="contiguous", causal=False, dtype=torch.float32),
              dict(method="ulysses", layout="contiguous", causal=True, dtype=torch.float32),
              # bf16 inputs: blocks travel in bf16, merging and accumulators stay fp32
              dict(method="ring", layout="zigzag", causal=True, dtype=torch.bfloat16),
              dict(method="ring", layout="contiguous", causal=False, dtype=torch.bfloat16),
              # plain multi-head (kv heads = heads): Ulysses moves kv heads without repeating them
              dict(method="ring", layout="zigzag", causal=True, dtype=torch.float64, Hkv=H),
              dict(method="ulysses", layout="zigzag", causal=True, dtype=torch.float64, Hkv=H)]
    for c in cases:
        c.update(B=B, S=S, H=H, D=D)
        c.setdefault("Hkv", HKV)
    return cases


def _attention_and_errors(cases):
    """Every case, then the bad inputs: each must raise ValueError before any collective."""
    results = run_cases(cases)
    cp = dist.get_world_size()
    group = Mesh(cp=cp).group("cp")
    # peak attention memory (MemTracker, forward + backward): cp ranks vs one rank on the full sequence
    alone = [dist.new_group([r]) for r in range(cp)][dist.get_rank()]
    mem = dict(S=128, B=1, H=4, Hkv=2, D=16, causal=True, dtype=torch.float32, memory=True)
    memory = {layout: attention_case(group=group, layout=layout, **mem)["peak_bytes"] for layout in LAYOUTS}
    memory["one rank"] = attention_case(group=alone, layout="contiguous", **mem)["peak_bytes"]
    errors = []
    bad = [
        # Ulysses with 3 heads on cp = 2 or 4 ranks: 3 % cp != 0
        lambda: ContextParallelAttention(group, "ulysses", "contiguous")(
            torch.zeros(1, 3, 4, 8), torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)),
        # zigzag with 5 local tokens: the global 5·cp is not divisible by 2·cp
        lambda: ContextParallelAttention(group, "ring", "zigzag")(
            torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)),
        # training on sequences of 9·cp tokens with zigzag (9·cp % 2·cp != 0)
        lambda: train_cp("tiny", [(torch.zeros(2, 9 * cp, dtype=torch.long),) * 2], group, "ring", "zigzag"),
        lambda: ContextParallelAttention(group, "rings", "zigzag"),
    ]
    for fn in bad:
        with CommCounter() as c:
            try:
                fn()
                errors.append(("no error", c.calls()))
            except ValueError as e:
                errors.append((str(e), c.calls()))
    return (results, errors, memory)


def _scores(cp, rank, layout, causal):
    """Unmasked (query, key) score entries rank `rank` must compute, counted from the mask."""
    pos = shard_positions(S, cp, rank, layout)
    keys = torch.arange(S)
    visible = (keys[None, :] <= pos[:, None]) if causal else torch.ones(len(pos), S, dtype=torch.bool)
    return B * H * int(visible.sum())


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_equals_sdpa_bytes_and_work(cp):
    cases = _cases(cp)
    per_rank = run_ranks(_attention_and_errors, cp, cases, timeout=240)
    c = S // cp
    for i, case in enumerate(cases):
        res = [r[0][i] for r in per_rank]
        shape = {k: case[k] for k in ("B", "S", "H", "Hkv", "D", "causal")}
        if case["dtype"] == torch.bfloat16:   # exact answer for the bf16-rounded inputs, in float64
            ref = full_attention(**shape, dtype=torch.float64, round_to=torch.bfloat16)
        else:
            ref = full_attention(**shape, dtype=case["dtype"])
        tol = dict(rtol=1e-12, atol=1e-12) if case["dtype"] == torch.float64 else dict(rtol=1e-5, atol=1e-5)
        for name in ("out", "dq", "dk", "dv"):
            got = gather_sequence([r[name] for r in res], case["layout"], dim=2)
            if case["dtype"] == torch.bfloat16:   # fp32 inside: only the final rounding to bf16 (2^-9 relative)
                excess = (got.double() - ref[name]).abs() - (ref[name].abs() * 2**-8 + 1e-6)
                assert excess.max() <= 0, (case, name, excess.max().item())
            else:
                torch.testing.assert_close(got, ref[name], **tol, msg=lambda m: f"{case} {name}: {m}")
        b = torch.tensor([], dtype=case["dtype"]).element_size()
        hkv = case["Hkv"]
        for r in res:
            fwd, bwd = r["bytes"]
            if case["method"] == "ring":   # THEORY.md: 2·c·d_kv elements per step, cp−1 steps
                block = 2 * B * c * hkv * D
                assert fwd == (cp - 1) * block * b
                acc = max(b, 4)            # dk, dv accumulate in fp32 (float64 stays float64)
                assert bwd == (cp - 1) * block * b + cp * block * acc  # k, v again + dk, dv all the way home
                assert r["calls"][0]["send"]["calls"] == 2 * (cp - 1)
                assert r["calls"][1]["send"]["calls"] == 2 * (cp - 1) + 2 * cp
            else:                          # two all-to-alls each way; kv heads repeated up to H if cp ∤ Hkv
                hk = hkv if hkv % cp == 0 else H
                assert fwd == bwd == B * c * (H + 2 * hk) * D * b + B * c * H * D * b
                assert r["calls"][0]["all_to_all"]["calls"] == r["calls"][1]["all_to_all"]["calls"] == 2
                assert "send" not in r["calls"][0]
        if case["method"] == "ring":
            scores = [r["work"]["scores"] for r in res]
            assert scores == [_scores(cp, rank, case["layout"], case["causal"]) for rank in range(cp)]
            flops = [r["work"]["flops"] for r in res]
            if case["causal"] and case["layout"] == "contiguous":   # rank r: r + 1/2 blocks' worth
                assert scores == sorted(scores) and len(set(scores)) == cp
                assert flops == [4 * B * H * c * c * D * (rank + 1) for rank in range(cp)]
            else:                                                   # zigzag (or no mask): all equal
                assert len(set(scores)) == 1 and len(set(flops)) == 1
            for rank, r in enumerate(res):   # at step t a rank computes on the block of rank (r − t) mod cp
                for phase, step, qc, kc in r["work"]["log"]:
                    assert qc in chunk_ids(case["layout"], cp, rank)
                    assert kc in chunk_ids(case["layout"], cp, (rank - step) % cp)
                    assert not case["causal"] or kc <= qc
    for rank, r in enumerate(per_rank):
        errors = r[1]
        assert [calls for _, calls in errors] == [0] * len(errors), errors
        msgs = [m for m, _ in errors]
        assert f"n_heads=3 is not divisible by {cp}" in msgs[0] and "ring attention" in msgs[0]
        assert f"{5 * cp} is not divisible by {2 * cp}" in msgs[1] and f"multiple of {2 * cp}" in msgs[1]
        assert f"{9 * cp} is not divisible by {2 * cp}" in msgs[2]
        assert "choose one of" in msgs[3]
    # memory: every rank holds S/cp of q, k, v and one score block of (S/cp)² or (S/2cp)² entries, so
    # its peak is below the one-rank peak divided by cp; zigzag ranks hold the same, contiguous
    # rank 0 skips every block but its own
    memory = [r[2] for r in per_rank]
    for layout in LAYOUTS:
        assert max(m[layout] for m in memory) < memory[0]["one rank"] / cp, memory
    assert len({m["zigzag"] for m in memory}) == 1, memory
    assert memory[0]["contiguous"] < memory[-1]["contiguous"], memory


def test_shard_gather_positions():
    x = torch.arange(2 * 48).view(2, 48)
    for cp in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            shards = [shard_sequence(x, cp, r, layout) for r in range(cp)]
            assert torch.equal(gather_sequence(shards, layout), x)
            assert all(s.shape == (2, 48 // cp) for s in shards)
            for r in range(cp):   # positions name the tokens held (x rows are 0..47 and 48..95)
                assert torch.equal(shard_positions(48, cp, r, layout), shards[r][0])
    assert shard_positions(16, 4, 1, "zigzag").tolist() == [2, 3, 12, 13]   # chunks 1 and 2·4−1−1 = 6
    with pytest.raises(ValueError, match="not divisible by 8.*multiple of 8"):
        shard_sequence(torch.zeros(1, 12), 4, 0, "zigzag")
    with pytest.raises(ValueError, match="not divisible by 5"):
        shard_sequence(torch.zeros(1, 12), 5, 0, "contiguous")


def _train_all(batches, configs):
    group = Mesh(cp=dist.get_world_size()).group("cp")
    out = []
    for method, layout in configs:
        losses, model = train_cp("tiny", batches, group, method, layout, lr=1e-3)
        out.append((losses, {n: p.detach() for n, p in model.named_parameters()}))
    return out


def test_shared_model_trains_like_one_process_with_cp2():
    batches = global_batches(3, 2, 32, seed=0)
    ref_losses, ref_model = train_reference(reference_model("tiny"), batches, lr=1e-3)
    configs = [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "zigzag")]
    per_rank = run_ranks(_train_all, 2, batches, configs, timeout=240)
    ref_params = dict(ref_model.named_parameters())
    for i, cfg in enumerate(configs):
        for losses, params in (r[i] for r in per_rank):
            assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6), cfg
            for n, p in params.items():
                torch.testing.assert_close(p, ref_params[n].detach(), rtol=1e-5, atol=1e-6, msg=f"{cfg} {n}")


def test_demo_runs_under_torchrun_and_plain_python():
    out = run_script("ring_attention.py", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                     "--repeats", "1", "--model-steps", "2", nproc=4)
    assert "all checks ok" in out and "ring zigzag" in out and "ulysses" in out
    out = run_script("ring_attention.py", "--seq", "32", "--repeats", "1", "--model-steps", "1", timeout=120)
    assert "all checks ok" in out
