"""Context parallel: ring attention (contiguous, zigzag), Ulysses and ring x Ulysses equal full-sequence
SDPA, send the bytes and compute the FLOPs the formulas say, balance causal work, train the shared model
like one process (lab.baseline.single_process); and the README's exercises."""
import pytest
import torch
import torch.distributed as dist

from lab import ring_attention_demo as cp_demo
import ring_attention as ra
from lab.baseline import single_process
from harness import Exercise, global_batches, run_ranks, run_script
from lab.instruments import CommCounter
from lab.model import build_model

B, S, H, HKV, D = 2, 32, 4, 2, 8
F64 = torch.float64


def gather_sequence(shards, layout, dim=1):
    """The inverse of ra.shard_sequence: the shards of ranks 0..cp-1 back into the whole sequence."""
    chunks = {}
    for r, s in enumerate(shards):
        ids = ra.chunk_ids(layout, len(shards), r)
        chunks.update(zip(ids, s.chunk(len(ids), dim)))
    return torch.cat([chunks[i] for i in sorted(chunks)], dim)


def full_attention(B, S, H, Hkv, D, causal, dtype, round_to=None):
    """The reference: the same seeded batch (cp_demo.seeded_inputs, seed 0 as cp_demo.attention_case's default) through
    whole-sequence SDPA, in one process."""
    q, k, v, dout = cp_demo.seeded_inputs(B, S, H, Hkv, D, dtype, 0, round_to=round_to)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=H != Hkv)
    out.backward(dout)
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _cases(cp):
    cases = [dict(method=m, layout=lay, causal=c, dtype=F64)
             for m in ("ring", "ulysses") for lay in ra.LAYOUTS for c in (True, False)]
    cases += [dict(method="ring", layout="zigzag", causal=True, dtype=torch.float32),
              dict(method="ring", layout="contiguous", causal=False, dtype=torch.float32),
              dict(method="ulysses", layout="contiguous", causal=True, dtype=torch.float32),
              # bf16 inputs: blocks travel in bf16, merging and accumulators stay fp32
              dict(method="ring", layout="zigzag", causal=True, dtype=torch.bfloat16),
              dict(method="ring", layout="contiguous", causal=False, dtype=torch.bfloat16),
              # plain multi-head (kv heads = heads): Ulysses moves kv heads without repeating them
              dict(method="ring", layout="zigzag", causal=True, dtype=F64, Hkv=H),
              dict(method="ulysses", layout="zigzag", causal=True, dtype=F64, Hkv=H)]
    if cp == 4:   # ring 2 x Ulysses 2
        cases += [dict(method="ulysses", layout=lay, causal=c, dtype=F64, U=2, Hkv=hkv)
                  for lay in ra.LAYOUTS for c in (True, False) for hkv in (HKV, 1)]
    for c in cases:
        c.update(B=B, S=S, H=H, D=D)
        c.setdefault("Hkv", HKV)
    return cases


def _rank(cases, train_configs):
    """Every case, peak memory, the bad inputs (each must raise before any collective), and training."""
    cp, world = dist.get_world_size(), dist.group.WORLD
    rings = ra.ring_ulysses_groups([list(range(cp))], 2) if cp == 4 else None
    results = []
    for case in cases:
        case = dict(case)
        hybrid = case.pop("U", None)
        results.append(cp_demo.attention_case(group=rings[1] if hybrid else world, ring_group=rings[0] if hybrid else None,
                                         **case))
    # peak attention memory (MemTracker, forward + backward): cp ranks against one rank on all of S
    alone = [dist.new_group([r]) for r in range(cp)][dist.get_rank()]
    mem = dict(S=128, B=1, H=4, Hkv=2, D=16, causal=True, dtype=torch.float32, memory=True)
    memory = {layout: cp_demo.attention_case(layout=layout, **mem)["peak_bytes"] for layout in ra.LAYOUTS}
    memory["one rank"] = cp_demo.attention_case(group=alone, layout="contiguous", **mem)["peak_bytes"]
    bad = [  # Ulysses with 3 heads on cp = 2 or 4 ranks; zigzag with 5 local tokens (5·cp % 2·cp); training on
        # sequences of 9·cp tokens with zigzag; an unknown method; a Ulysses size that does not divide cp
        lambda: ra.ContextParallelAttention(world, "ulysses", "contiguous")(
            torch.zeros(1, 3, 4, 8), torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)),
        lambda: ra.ContextParallelAttention(world, "ring", "zigzag")(
            torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)),
        lambda: cp_demo.train_cp("tiny", [(torch.zeros(2, 9 * cp, dtype=torch.long),) * 2], world, "ring", "zigzag"),
        lambda: ra.ContextParallelAttention(world, "rings", "zigzag"),
        lambda: ra.ring_ulysses_groups([list(range(cp))], 3),
    ]
    errors = []
    for fn in bad:
        with CommCounter() as c:
            try:
                fn()
                errors.append(("no error", c.calls()))
            except ValueError as e:
                errors.append((str(e), c.calls()))
    batches = global_batches(3, 2, 32, seed=0)
    trained = [cp_demo.train_cp(model, batches, world, method, layout, dtype=F64)
               for model, method, layout in train_configs]
    return results, errors, memory, [(losses, {n: p.detach() for n, p in m.named_parameters()})
                                     for losses, m in trained]


# (tiny-gpt2: learned positions, at each rank's true positions in the contiguous layout too — train.py's is zigzag)
TRAIN = [("tiny", "ring", "contiguous"), ("tiny", "ring", "zigzag"), ("tiny", "ulysses", "zigzag"),
         ("tiny-gpt2", "ring", "contiguous")]


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_equals_sdpa_bytes_flops_memory_errors(cp):
    cases = _cases(cp)
    per_rank = run_ranks(_rank, cp, cases, TRAIN if cp == 2 else [], timeout=300)
    c = S // cp
    for i, case in enumerate(cases):
        res = [r[0][i] for r in per_rank]
        shape = {k: case[k] for k in ("B", "S", "H", "Hkv", "D", "causal")}
        exact = case["dtype"] == torch.bfloat16   # the exact answer for the bf16-rounded inputs, in float64
        ref = full_attention(**shape, dtype=F64 if exact else case["dtype"],
                                round_to=torch.bfloat16 if exact else None)
        tol = dict(rtol=1e-12, atol=1e-12) if case["dtype"] == F64 else dict(rtol=1e-5, atol=1e-5)
        for name in ("out", "dq", "dk", "dv"):
            got = gather_sequence([r[name] for r in res], case["layout"], dim=2)
            if exact:   # fp32 inside: only the final rounding to bf16 (2^-9 relative)
                excess = (got.double() - ref[name]).abs() - (ref[name].abs() * 2**-8 + 1e-6)
                assert excess.max() <= 0, (case, name, excess.max().item())
            else:
                torch.testing.assert_close(got, ref[name], **tol, msg=lambda m: f"{case} {name}: {m}")
        b, hkv = torch.tensor([], dtype=case["dtype"]).element_size(), case["Hkv"]
        U = case.get("U", cp if case["method"] == "ulysses" else 1)   # the all-to-all's size; the ring is cp/U
        R, hk = cp // U, hkv if hkv % U == 0 else H                     # kv heads after repeating
        for rank, r in enumerate(res):
            fwd, bwd = r["bytes"]
            ring = cp_demo.ring_bytes(B, U * c, hk // U, D, R, b)   # (cp−1)·2·c·d_kv·b, + cp·2·c·d_kv·4 back
            uly = cp_demo.ulysses_bytes(B, c, H, hkv, D, U, b)        # formula: c·(H + 2·H_kv)·D·b + c·H·D·b each way
            assert (fwd, bwd) == (ring[0] + uly, ring[1] + uly), (case, fwd, bwd)
            assert r["calls"][0].get("send", {}).get("calls", 0) == 2 * (R - 1)
            assert r["calls"][1].get("send", {}).get("calls", 0) == (2 * (R - 1) + 2 * R if R > 1 else 0)
            assert r["calls"][0].get("all_to_all", {}).get("calls", 0) == (2 if U > 1 else 0)
            if R > 1:   # FlopCounterMode's matmul FLOPs = arithmetic on the ring's schedule
                want = cp_demo.schedule_work(R, rank // U, case["layout"], case["causal"], B, H // U, U * c, D)
                assert r["flops"] == (want["fwd"], want["bwd"]), (case, rank, r["flops"], want)
        if case["method"] == "ring":
            flops = [r["flops"][0] for r in res]
            if case["causal"] and case["layout"] == "contiguous":   # rank r: r + 1 whole c x c blocks
                assert flops == [4 * B * H * c * c * D * (rank + 1) for rank in range(cp)]
            else:                                                   # zigzag (or no mask): all equal
                assert len(set(flops)) == 1
    for r in per_rank:
        errors = r[1]
        assert [calls for _, calls in errors] == [0] * len(errors), errors
        msgs = [m for m, _ in errors]
        assert f"n_heads=3 is not divisible by {cp}" in msgs[0] and "ring attention" in msgs[0]
        assert f"{5 * cp} is not divisible by {2 * cp}" in msgs[1] and f"multiple of {2 * cp}" in msgs[1]
        assert f"{9 * cp} is not divisible by {2 * cp}" in msgs[2]
        assert "choose one of" in msgs[3] and "must divide the cp size" in msgs[4]
    # memory: each rank holds S/cp of q, k, v and one score block of (S/cp)² or (S/2cp)² entries, so its
    # peak is below the one-rank peak / cp; zigzag ranks all hold the same; contiguous rank 0 skips blocks
    memory = [r[2] for r in per_rank]
    for layout in ra.LAYOUTS:
        assert max(m[layout] for m in memory) < memory[0]["one rank"] / cp, memory
    assert len({m["zigzag"] for m in memory}) == 1 and memory[0]["contiguous"] < memory[-1]["contiguous"], memory
    if cp == 2:   # the shared model trained with cp = 2 gives the one-process losses and parameters (in float64:
        for i, config in enumerate(TRAIN):
            one = single_process(build_model(config[0], dtype=F64), global_batches(3, 2, 32, seed=0))  # lab/baseline.py)
            params = dict(one["model"].named_parameters())
            for losses, trained in (r[3][i] for r in per_rank):
                assert losses == pytest.approx(one["losses"], rel=1e-12, abs=1e-12), config
                for n, p in trained.items():
                    torch.testing.assert_close(p, params[n].detach(), rtol=1e-10, atol=1e-12, msg=f"{config} {n}")


def test_schedule_layouts_and_merge():
    x = torch.arange(2 * 48).view(2, 48)
    for cp in (1, 2, 3, 4):
        for layout in ra.LAYOUTS:
            shards = [ra.shard_sequence(x, cp, r, layout) for r in range(cp)]
            assert torch.equal(gather_sequence(shards, layout), x) and all(s.shape == (2, 48 // cp) for s in shards)
            for r in range(cp):
                assert torch.equal(ra.shard_positions(48, cp, r, layout), shards[r][0])  # positions name the tokens
                for causal in (True, False):
                    plan = ra.ring_schedule(cp, r, layout, causal)
                    assert [(t, src) for t, src, _ in plan] == [(t, (r - t) % cp) for t in range(cp)]
                    mine, seen = ra.chunk_ids(layout, cp, r), torch.zeros(48, 48, dtype=torch.bool)
                    for _, src, pairs in plan:   # the pairs cover exactly my rows of the mask, once each
                        for i, j, diagonal in pairs:
                            qc, kc = mine[i], ra.chunk_ids(layout, cp, src)[j]
                            n = 48 // len(mine) // cp
                            block = seen[qc * n:(qc + 1) * n, kc * n:(kc + 1) * n]
                            assert not block.any() and diagonal == (causal and qc == kc)
                            block |= torch.ones(n, n, dtype=torch.bool).tril() if diagonal else True
                    pos = ra.shard_positions(48, cp, r, layout)
                    keys = torch.arange(48)
                    visible = keys[None, :] <= pos[:, None] if causal else torch.ones(len(pos), 48, dtype=torch.bool)
                    want = cp_demo.schedule_work(cp, r, layout, causal, 1, 1, 48 // cp, 1)["scores"]
                    assert int(seen.sum()) == int(visible.sum()) == want
    # the contiguous split gives rank r (r + 1/2)·c² useful scores, zigzag the same to every rank
    c = 64 // 4
    assert [cp_demo.schedule_work(4, r, "contiguous", True, 1, 1, c, 1)["scores"] for r in range(4)] == \
        [r * c * c + c * (c + 1) // 2 for r in range(4)]
    assert len({cp_demo.schedule_work(4, r, "zigzag", True, 1, 1, c, 1)["scores"] for r in range(4)}) == 1
    with pytest.raises(ValueError, match="not divisible by 8.*multiple of 8"):
        ra.shard_sequence(torch.zeros(1, 12), 4, 0, "zigzag")
    # the logsigmoid merge equals the textbook's running-max form, scores near 0 and far past exp's range
    gen = torch.Generator().manual_seed(0)
    for scale in (1.0, 1000.0):
        out, lse = torch.randn(3, 5, 4, generator=gen, dtype=F64), torch.randn(3, 5, generator=gen, dtype=F64) * scale
        bo, bl = torch.randn(3, 5, 4, generator=gen, dtype=F64), torch.randn(3, 5, generator=gen, dtype=F64) * scale
        for a, b in zip(ra.merge(out, lse, bo, bl), ra.merge_textbook(out, lse, bo, bl)):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
        if scale == 1.0:   # and both equal the softmax over the union, computed directly
            w = torch.softmax(torch.stack([lse, bl]), 0)
            torch.testing.assert_close(ra.merge(out, lse, bo, bl)[0], w[0, ..., None] * out + w[1, ..., None] * bo)


def test_demo_runs_under_torchrun_and_plain_python():
    out = run_script("ring_attention.py", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                     "--repeats", "1", "--model-steps", "2", "--q-scale", "100", nproc=4)   # logsigmoid: no overflow
    assert "all checks ok" in out and "ring zigzag" in out and "ring 2 x ulysses 2 zigzag" in out
    out = run_script("ring_attention.py", "--seq", "32", "--repeats", "1", "--model-steps", "1")
    assert "all checks ok" in out


# ---- the README's exercises, checked as a learner would -------------------------------------------

def _rows(out):
    """{row name: the numbers printed after it} for the per-rank table of the demo."""
    rows = {}
    for line in out.splitlines():
        for name in ("ring contiguous", "ring zigzag", "ulysses contiguous", "ring 2 x ulysses 2 zigzag"):
            if line.strip().startswith(name + " "):
                rows.setdefault(name, line.strip()[len(name):].split())  # the table comes first
    return rows


def _check_balance(out):
    rows = _rows(out)
    # rank r: r + 1 blocks of 4·B·H·c²·D (c = 128), zigzag 2·cp + 1 blocks of (c/2)²: 9/4 of one
    assert rows["ring contiguous"][1:5] == [f"{4 * 8 * 128 * 128 * 32 * (r + 1) / 1e6:.1f}" for r in range(4)]
    assert rows["ring contiguous"][1:5] == ["16.8", "33.6", "50.3", "67.1"] and rows["ring zigzag"][1:5] == ["37.7"] * 4
    assert "waits ms per rank" in out and "all checks ok" in out


def _check_no_causal(out):
    rows = _rows(out)
    assert rows["ring contiguous"][1:5] == rows["ring zigzag"][1:5] and len(set(rows["ring zigzag"][1:5])) == 1
    assert "all checks ok" in out


def _check_gqa(out):
    rows = _rows(out)   # B·c·(H + 2·H)·D·4 + B·c·H·D·4 each way: c = 128, H = 8, D = 32
    assert rows["ulysses contiguous"][-2] == "1,048,576" == f"{2 * (128 * 24 * 32 * 4 + 128 * 8 * 32 * 4):,d}"
    assert "all checks ok" in out


def _check_six_heads(out):
    assert "(ulysses contiguous skipped: 6 heads are not divisible by 4)" in out
    assert "ring 2 x ulysses 2 zigzag" in _rows(out) and "all checks ok" in out


def _check_naive_merge(out):
    rows = _rows(out)
    assert rows["ring zigzag"][0] == "nan" and rows["ring contiguous"][0] == "nan"
    assert float(rows["ulysses contiguous"][0]) < 1e-4          # SDPA inside: untouched
    assert "all checks FAILED" in out


EXERCISES = [
    Exercise("torchrun --nproc_per_node 4 ring_attention.py", _check_balance),
    Exercise("torchrun --nproc_per_node 4 ring_attention.py --no-causal", _check_no_causal),
    Exercise("torchrun --nproc_per_node 4 ring_attention.py --heads 8 --kv-heads 2", _check_gqa),
    Exercise("torchrun --nproc_per_node 4 ring_attention.py --heads 6 --kv-heads 2", _check_six_heads),
    Exercise("torchrun --nproc_per_node 4 ring_attention.py --seq 64 --q-scale 100", _check_naive_merge, fails=True,
             edits=(("ring_attention.py", "outs[i], lses[i] = merge(", "outs[i], lses[i] = merge_textbook("),
                    ("ring_attention.py", "m = torch.maximum(lse, block_lse)", "m = torch.zeros_like(lse)"))),
]
