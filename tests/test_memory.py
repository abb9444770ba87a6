"""Memory (issue 24): activation checkpointing (none, selective, full) composed with every mesh dimension and
equal to one process; the activation bytes a block keeps measured against lab.train_demo.activation_formula."""
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
    for lay in res[0]:
        want = reference_losses(parse_args(COMMON + lay["flags"].split()))
        err = max(abs(a - b) for a, b in zip(lay["losses"], want))
        assert err < 1e-9, (lay["flags"], err)


@pytest.mark.parametrize("world, dtype, sp", [(1, torch.float32, False), (1, torch.bfloat16, False),
                                              (1, torch.float64, False), (2, torch.float32, False),
                                              (2, torch.bfloat16, True), (4, torch.float32, True)])
def test_activation_bytes_equal_the_formula(world, dtype, sp):
    """What one block keeps after its forward, per token, for none / selective / full, measured from the tensors
    still alive (instruments.HeldBytes) — equal to activation_formula to the byte, with tp = world."""
    res = run_ranks(activation_profile, world, dtype=dtype, sp=sp, repeats=1, timeout=120)[0]
    for how, r in res.items():
        assert r["bytes_per_token"] == r["formula"], (how, r)
    assert res["none"]["bytes_per_token"] > res["selective"]["bytes_per_token"] > res["full"]["bytes_per_token"] == 0


OFFLOAD = [["--dp-shard", "2", "--zero-stage", str(z)] for z in range(4)] + [
    ["--tp", "2"], ["--pp", "2", "--microbatches", "2"], ["--experts", "4", "--dp-shard", "2", "--ep", "2"],
    ["--dp-shard", "2", "--activation-checkpointing", "selective"]]


def test_offload_equals_one_process_and_moves_what_the_formula_says():
    """--offload (the fp32 master and AdamW state in host memory, the optimizer stepping there) on every ZeRO
    stage and with tp, pp and experts: equal to one process; per step each rank moves exactly each reduced
    gradient slice down (b_m·n) and each new compute slice up (b_p·n), counted by wrapping FlatUnit's
    download and upload from outside. In bf16 the way up carries half the bytes."""
    res = run_ranks(run_layouts, 2, [lay + ["--offload"] for lay in OFFLOAD], COMMON, timeout=600)
    for lay in res[0]:
        want = reference_losses(parse_args(COMMON + lay["flags"].split()))
        assert max(abs(a - b) for a, b in zip(lay["losses"], want)) < 1e-9, lay["flags"]
        assert lay["offload_bytes"] == [lay["offload_formula"]] * len(lay["losses"]) and lay["offload_formula"][0] > 0
    bf16 = run_ranks(run_layouts, 2, [["--dp-shard", "2", "--offload", "--dtype", "bfloat16"]], ["--steps", "2"],
                     timeout=120)[0][0]
    down, up = bf16["offload_formula"]
    assert bf16["offload_bytes"] == [(down, up)] * 2 and down == 2 * up
