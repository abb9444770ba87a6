"""train.py --check's diagnosis (lab/mismatch.py): where a parallel run first differs from one process.

Bugs are seeded into the STRATEGIES' code — a line of ddp.py, fsdp.py, hsdp.py, tensor_parallel.py, pipeline.py,
ring_attention.py or expert_parallel.py changed in a copy, run with `--lesson NAME=FILE` (lab/changed_lesson.py), as
a learner runs an edited lesson — and each must be located by --check at the right place: the step, the place in
it, the rank, the tensor, the pattern, and the collective that made it (or that none ran), read from the report's
first lines. At least two per strategy (ddp, ZeRO, HSDP, tp and sp, pp, cp, ep), some inside a larger mesh (4
ranks: the piece mapped back through two dimensions at once), on the course's model, a Hugging
Face Llama started from a directory, and GPT-2's options (a head tied across pipeline stages). Correct layouts,
replayed with every place compared, report no difference, and every kind of place is compared (a check that
compares nothing cannot fail). float32 and bf16: rounding is judged rounding, a bug a bug. A bad --lesson is one
error on every rank before any collective. All in float64 on the tiny model, 2 steps, many runs per spawned group.
"""
import os
import sys

import pytest
import torch

from harness import Exercise, refusals, run_ranks
from lab.train_demo import reference_run, run_layouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--check", "--dtype", "float64", "--steps", "2", "--seq-len", "16", "--global-batch-size", "8"]
MOE = "--experts 4 --dp-shard 2 --ep 2"
GPT_PP = "--model tiny-gpt2 --pp 2 --schedule zb"


# name: (lesson, the line as it is, as the seeded bug has it, the layout, what the report's first line says, what
# its "made by" line says)
SEEDED = {
    # ddp.py: data parallel's buckets (ZeRO-0)
    "ddp: the bucket's ÷P dropped": (
        "ddp", "            bucket.flat.div_(bucket.divide_by)  # divide first: the sum is then the average\n", "",
        "--dp-replicate 2", ["step 1, the gradients after the sync, rank 0: norm.weight", "2× the expected (2 = dp·cp"],
        ["all_reduce over ranks [0, 1]", "in _launch_in_order"]),
    "ddp: the first bucket never all-reduced": (
        "ddp", "            if dist.get_world_size(bucket.group) > 1:\n                bucket.work",
        "            if dist.get_world_size(bucket.group) > 1 and self._next > 0:\n                bucket.work",
        "--dp-replicate 2", ["the gradients after the sync, rank 0: norm.weight",
                             "this rank's own gradient ÷ 2: never summed"], ["no collective ran in the sync"]),
    # fsdp.py: ZeRO
    "ZeRO: the reduce-scatter's ÷P dropped": (
        "fsdp", "            out.div_(u.divide_by)  # gloo has no ReduceOp.AVG: sum, then divide\n", "",
        "--dp-shard 2 --zero-stage 2", ["the gradients after the sync, rank 1: output.weight",
                                        "of a ZeRO unit over ranks [0, 1]", "2× the expected (2 = dp·cp)"],
        ["reduce_scatter over ranks [0, 1]", "in reduce_unit"]),
    "ZeRO: no all-gather after the step": (
        "fsdp", "            u.publish()  # my new compute slice; stages 1-2 gather the others', stage 3 drops a "
                "gathered copy", "            u.refresh_shard()",
        "--dp-shard 2 --zero-stage 2", ["step 2, the parameters as the forward uses them, rank 0: tok_embeddings",
                                        "only this rank's slice [0, 4096) was updated", "the all-gather after the "
                                        "step is missing"], ["no collective ran before the forward used it"]),
    "ZeRO-3: the gathered shard off by one": (
        "fsdp", "return all_gather_single(self.buf, self.shard.detach(), group",
        "return all_gather_single(self.buf, self.shard.detach().roll(1), group",
        "--dp-shard 2 --zero-stage 3", ["step 1, the parameters as the forward uses them, rank 0: tok_embeddings",
                                        "rolled by +1 element(s)", "an offset off by +1"],
        ["all_gather over ranks [0, 1]", "in unshard"]),
    # hsdp.py (2 replicas x 2 shards, 4 ranks)
    "HSDP: no all-reduce across replicas": (
        "hsdp", "        dist.all_reduce(t, group=replicate_group)\n", "",
        "--dp-replicate 2 --dp-shard 2", ["the gradients after the sync, rank 1: output.weight",
                                          "a part of a sum: the values of ranks [1, 3]"],
        ["reduce_scatter over ranks [0, 1]"]),
    "HSDP: divided by R once more": (
        "hsdp", "        dist.all_reduce(t, group=replicate_group)\n",
        "        dist.all_reduce(t, group=replicate_group)\n        if t.is_floating_point():\n"
        "            t.div_(dist.get_world_size(replicate_group))\n",
        "--dp-replicate 2 --dp-shard 2", ["the gradients after the sync, rank 1: output.weight",
                                          "1/2 of the expected (2 = dp_replicate)"],
        ["all_reduce over ranks [1, 3]", "in all_reduce_across"]),
    # tensor_parallel.py
    "tp: f's backward all-reduce dropped": (
        "tensor_parallel", "F_TP = (_identity,           _all_reduce)", "F_TP = (_identity,           _identity)",
        "--tp 2", ["step 1, the gradients after backward, rank 0: norm.weight",
                   "add up to the expected only summed over the tp ranks too (ranks [0, 1])"],
        ["no collective ran in the backward of output and norm"]),
    "tp: g's backward all-reduces too": (
        "tensor_parallel", "G_TP = (_all_reduce,         _identity)", "G_TP = (_all_reduce,         _all_reduce)",
        "--tp 2", ["step 1, the gradients after backward, rank 0: layers.1.mlp.w2.weight [32, 64], its [0:32] along "
                   "dim 1", "2× the expected (2 = tp)"], ["all_reduce over ranks [0, 1]", "in _all_reduce"]),
    "tp: the loss's partition sum not all-reduced": (
        "tensor_parallel", "            dist.all_reduce(sum_exp, group=group)                             "
                           "# 3: the partition sum\n", "",
        "--tp 2", ["step 1, the loss, rank 0", "while every module's output agrees"],
        ["all_reduce over ranks [0, 1] of 128 float64", "in forward"]),
    "sp: the norms' partial gradients not marked": (
        "tensor_parallel", 'partial = ("weight", "bias") if isinstance(mod, (RMSNorm, LayerNorm)) else',
        'partial = () if isinstance(mod, (RMSNorm, LayerNorm)) else',
        "--tp 2 --sequence-parallel", ["the gradients after backward, rank 0: norm.weight",
                                       "only summed over the tp ranks too"],
        ["reduce_scatter over ranks [0, 1]", "in _reduce_scatter_seq"]),
    # pipeline.py
    "pp: the loss's 1/m missing": (
        "pipeline", "outputs[key] = [out / m if last else out]", "outputs[key] = [out if last else out]",
        "--pp 2", ["step 1, the gradients after backward, rank 1: output.weight",
                   "2× the expected (2 = m, the micro-batches)"], ["no collective ran in output's backward"]),
    "pp: the tied head's halves never summed": (
        "pipeline", "    dist.all_reduce(w.grad, group=group)\n", "",
        GPT_PP, ["the gradients after the sync, rank 0: tok_embeddings.weight",
                 "this rank's own gradient, never summed with the other ranks' parts"],
        ["no collective ran in the sync"]),
    # ring_attention.py
    "cp: dk, dv never brought home": (
        "ring_attention", "        dk, dv = acc.wait() if acc is not None else (dk, dv)",
        "        dk, dv = (acc.wait(), (dk, dv))[1] if acc is not None else (dk, dv)",
        "--cp 2", ["step 1, the gradients after backward, rank 0: layers.1.attn.wv.weight", "in no simple pattern"],
        ["recv over ranks [0, 1]", "in backward"]),
    "cp: rotary positions of the contiguous layout": (
        "ring_attention", "    return shard_sequence(torch.arange(seq_len), cp, rank, layout, dim=0)",
        '    return shard_sequence(torch.arange(seq_len), cp, rank, "contiguous", dim=0)',
        "--cp 2", ["every module's output in forward, rank 0: layers.0.attn's output",
                   "wrong at sequence positions 12-15 (zigzag chunks [3] of 4), right at 0-3"],
        ["recv over ranks [0, 1]"]),
    # expert_parallel.py
    "ep: an expert's tokens combined twice": (
        "expert_parallel", "        out = torch.zeros_like(x).index_add(0, tok, back * weights.flatten()[sel, None])\n",
        "        out = torch.zeros_like(x).index_add(0, tok, back * weights.flatten()[sel, None])\n"
        "        out = out.index_add(0, tok, back * weights.flatten()[sel, None])\n",
        MOE, ["step 1, every module's output in forward, rank 0: layers.0.mlp's output", "2× the expected"],
        ["all_to_all over ranks [0, 1]", "in dispatch_combine"]),
    "ep: the aux loss's gradient not scaled by D": (
        "expert_parallel", "(S_local - S_local.detach()) * (self.grad_divisor / N.item())",
        "(S_local - S_local.detach()) * (1 / N.item())",
        MOE, ["step 1, the gradients after backward, rank 0: layers.1.mlp.router.weight", "in no simple pattern"],
        ["all_to_all over ranks [0, 1]"]),
}
FOUR = {"HSDP: no all-reduce across replicas", "HSDP: divided by R once more"}
# the same seeded lessons inside a larger mesh (4 ranks): name -> (the seeded bug, the layout, what the first line
# says, what its "made by" line says)
NESTED = {
    "tp inside dp x tp": ("tp: f's backward all-reduce dropped", "--dp-shard 2 --tp 2",
                          ["the gradients after backward, rank 0: norm.weight", "summed over ranks [0, 2] ÷ 2",
                           "only summed over the tp ranks too"], ["no collective ran in the backward of output"]),
    "ZeRO-3 inside dp x tp": ("ZeRO-3: the gathered shard off by one", "--dp-shard 2 --zero-stage 3 --tp 2",
                              ["the parameters as the forward uses them, rank 0: tok_embeddings.weight [256, 32], "
                               "its [0:128] along dim 0", "rolled by +1 element(s)"],
                              ["all_gather over ranks [0, 2]", "in unshard"]),
    "sp inside pp x tp": ("sp: the norms' partial gradients not marked", "--pp 2 --tp 2 --sequence-parallel",
                          ["the gradients after backward, rank 2: norm.weight", "over the tp ranks too (ranks [2, 3])"],
                          ["reduce_scatter over ranks [2, 3]", "in _reduce_scatter_seq"]),
    "cp's rotary inside dp x cp": ("cp: rotary positions of the contiguous layout", "--dp-shard 2 --cp 2",
                                   ["every module's output in forward, rank 0: layers.0.attn's output",
                                    "rows 0-3 of the global batch", "zigzag chunks [3] of 4"], ["recv over ranks [0, 1]"]),
}
# seeded on the Hugging Face Llama; seeded in a bf16 run only (its float64 replay locates it all the same)
ON_LLAMA, IN_BF16 = "tp: f's backward all-reduce dropped", "ZeRO: the reduce-scatter's ÷P dropped"
# the same bugs in float32 and bf16 runs, and correct ones held to a tolerance below their rounding
DTYPES = {"float32 bug": ("tp: f's backward all-reduce dropped", "--dtype float32"),
          "bf16 bug": (IN_BF16, "--dtype bfloat16"),
          "float32 rounding": (None, "--tp 2 --dtype float32 --check-tolerance 1e-9"),
          "bf16 rounding": (None, "--dp-shard 2 --dtype bfloat16 --check-tolerance 1e-9"),
          # float8 quantizes every matmul, which one process does not: its float64 run is judged as float32's is
          "float8 bug": ("tp: f's backward all-reduce dropped", "--float8"),
          "float8 rounding": (None, "--tp 2 --float8")}
CORRECT = ["--dp-replicate 2", "--dp-shard 2 --zero-stage 3", "--tp 2 --sequence-parallel",
           "--pp 2 --schedule interleaved --virtual-stages 2 --layers 4", "--cp 2 --cp-method ulysses", MOE, GPT_PP,
           "--dp-shard 2 --zero-stage 1 --pad-share 0.6 --activation-checkpointing full --microbatches 2"]
ONE_STEP = "--steps 1"   # where the first difference is in step 1, one step is enough to see it


def _seed(tmp, name):
    """The lesson with the seeded bug, as a learner's edited copy: its --lesson flag."""
    lesson, old, new = SEEDED[name][:3]
    text = open(os.path.join(ROOT, lesson + ".py")).read()
    assert text.count(old) == 1, (name, old)
    path = os.path.join(tmp, f"{lesson}_{abs(hash(name)) % 10**6}.py")
    with open(path, "w") as f:
        f.write(text.replace(old, new))
    return f"--lesson {lesson}={path}"


def _llama(tmp):
    """A tiny Hugging Face Llama written by save_pretrained (float64, random weights)."""
    import transformers
    import test_hf
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    path = os.path.join(tmp, "llama")
    transformers.LlamaForCausalLM(test_hf.llama_config(False, 256)).to(torch.float64).save_pretrained(path)
    return path


def _replays(layouts, common):
    """Rank function: each correct layout replayed with every place compared (mismatch.first_difference, as if its
    losses had differed at the last step): its report's lines."""
    from lab import mismatch
    from train import parse_args
    out = []
    for flags in layouts:
        args = parse_args([*common, *flags])
        out.append(mismatch.first_difference(args, torch.device("cpu"), args.steps, reference_run)[0])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module: seeded bugs and dtype cases on 2 ranks (one spawned group), HSDP's on 4, and the
    correct layouts replayed. name -> (the layout's result on rank 0, on rank 1, ...)."""
    tmp = str(tmp_path_factory.mktemp("seeded"))
    llama = _llama(tmp)

    def layout(name, extra=""):
        steps = "" if "step 2" in SEEDED[name][4][0] else ONE_STEP
        return f"{SEEDED[name][3]} {_seed(tmp, name)} {steps} {extra}"
    two = {name: layout(name) for name in SEEDED if name not in FOUR | {ON_LLAMA, IN_BF16}}
    two |= {ON_LLAMA: layout(ON_LLAMA, f"--init-from {llama}"), "Llama, correct": f"--tp 2 --init-from {llama}"}
    two |= {name: (layout(bug) if bug else ONE_STEP) + " " + flags for name, (bug, flags) in DTYPES.items()}
    four = {name: layout(name) for name in FOUR}
    four |= {name: f"{flags} {_seed(tmp, bug)} {ONE_STEP}" for name, (bug, flags, *_) in NESTED.items()}
    out = {}
    for world, cases in ((2, two), (4, four)):
        res = run_ranks(run_layouts, world, [f.split() for f in cases.values()], COMMON, timeout=900)
        out.update({name: tuple(r[i] for r in res) for i, name in enumerate(cases)})
    out[IN_BF16] = out["bf16 bug"]
    out["replayed"] = run_ranks(_replays, 2, [f.split() for f in CORRECT], [c for c in COMMON if c != "--check"],
                                timeout=600)
    return out


@pytest.mark.parametrize("name", sorted(SEEDED))
def test_a_seeded_bug_is_located(runs, name):
    """Its first line names the step, the place, the rank, the tensor and the pattern; the next the collective that
    made it (or that none ran); the verdict is a bug; every rank holds the same report and fails the check."""
    first, made = SEEDED[name][4:]
    lines = runs[name][0]["check_report"]
    assert all(not r["check_ok"] and r["check_report"] == lines for r in runs[name]), lines
    assert lines[0].startswith("  first difference from one process: ") and all(f in lines[0] for f in first), lines
    assert lines[1].startswith("  made by: ") and all(f in lines[1] for f in made), lines
    assert lines[-1].startswith("  verdict: a bug"), lines


@pytest.mark.parametrize("name", sorted(NESTED))
def test_a_seeded_bug_is_located_inside_a_larger_mesh(runs, name):
    """The piece mapped back through two dimensions at once (the dp rows and the tp slice, a stage and its tp
    ranks, the dp rows and the zigzag chunks); every rank holds the same report."""
    first, made = NESTED[name][2:]
    reports = [r["check_report"] for r in runs[name]]
    lines = reports[0]
    assert all(not r["check_ok"] for r in runs[name]) and all(r == lines for r in reports), lines
    assert all(f in lines[0] for f in first) and all(f in lines[1] for f in made), lines
    assert lines[-1].startswith("  verdict: a bug"), lines


def test_on_a_hugging_face_llama(runs):
    """--init-from a save_pretrained directory: correct is ok (and tp's missing backward all-reduce, seeded on it,
    is located: test_a_seeded_bug_is_located)."""
    assert runs["Llama, correct"][0]["check_ok"] and not runs["Llama, correct"][0]["check_report"]


def test_float32_and_bf16_rounding_is_rounding_a_bug_is_a_bug(runs):
    """A correct run held to 1e-9 differs by its rounding: judged rounding (float64 replay exact, parameters within
    AdamW's reach) and the check passes. A seeded bug in a float32 or bf16 run: located in float64, judged a bug.
    float8 (a float64 run): its quantization judged as float32's rounding is; a bug located in float64 without it."""
    for name in ("float32 rounding", "bf16 rounding", "float8 rounding"):
        r0 = runs[name][0]
        assert r0["check_ok"] and r0["check_report"][-1].startswith("  verdict: rounding, not a bug"), r0
    assert "float8's quantization" in runs["float8 rounding"][0]["check_report"][-1]
    for name in ("float32 bug", "bf16 bug", "float8 bug"):
        lines = runs[name][0]["check_report"]
        assert all(f in lines[0] for f in SEEDED[DTYPES[name][0]][4]), lines
        assert lines[-1].startswith("  verdict: a bug") and "replayed in float64" in lines[-1], lines
    assert "replayed in float64 without float8" in runs["float8 bug"][0]["check_report"][-1]


def test_correct_layouts_report_no_difference_at_any_place(runs):
    """Replayed with every place compared, a correct layout differs nowhere — and every kind of place was compared."""
    for flags, lines in zip(CORRECT, runs["replayed"][0]):
        assert len(lines) == 1 and lines[0].startswith("  no place of steps 1-2 differs"), (flags, lines)
        counts = lines[0].split("(")[1].split(" pieces compared")[0].split(", ")
        assert all(int(c.split()[0]) > 0 for c in counts) and len(counts) == 7, (flags, counts)


def test_a_bad_lesson_flag_is_one_error_on_every_rank_before_any_collective(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import nothing_of_that_name\n")
    cases = [["--tp", "2", "--lesson", "tensor_paralel=x.py"], ["--tp", "2", "--lesson", "tensor_parallel=missing.py"],
             ["--tp", "2", "--lesson", f"tensor_parallel={broken}"]]
    want = ["NAME one of mesh, ddp", "is not a file", "the file does not import (ModuleNotFoundError"]
    for rank in run_ranks(refusals, 2, cases, timeout=120):
        for (msg, calls), w in zip(rank, want):
            assert msg is not None and w in msg and calls == 0, (msg, calls)


def test_a_changed_lesson_is_put_back():
    """Inside lessons_in_place the course's modules hold the changed lesson; after, the original again."""
    import fsdp
    import hsdp
    import train
    from lab.changed_lesson import lessons_in_place
    with lessons_in_place([f"fsdp={os.path.join(ROOT, 'fsdp.py')}"]):
        assert sys.modules["fsdp"] is not fsdp and train.fsdp is sys.modules["fsdp"]
        assert hsdp.shard_model is sys.modules["fsdp"].shard_model   # (hsdp's `from fsdp import shard_model`)
    assert sys.modules["fsdp"] is fsdp and train.fsdp is fsdp and hsdp.shard_model is fsdp.shard_model


# ---- the README's exercises (lesson 8): break one line of a lesson, read --check's diagnosis ---------------------

def _says(*fragments):
    def check(out):
        assert "MISMATCH" in out and all(f in out for f in fragments), out[-3000:]
    return check


def _rounding(out):
    assert "MISMATCH" in out and "verdict: rounding, not a bug" in out, out[-3000:]


EXERCISES = [
    Exercise("torchrun --nproc_per_node 2 train.py --tp 2 --dtype float64 --steps 2 --check "
             "--lesson tensor_parallel=my_tp.py", _says(
                 "step 1, the gradients after backward, rank 0: norm.weight", "summed over the tp ranks too",
                 "made by: no collective ran in the backward of output and norm"), fails=True,
             edits=(("tensor_parallel.py -> my_tp.py", "F_TP = (_identity,           _all_reduce)",
                     "F_TP = (_identity,           _identity)"),)),
    Exercise("torchrun --nproc_per_node 2 train.py --dp-shard 2 --zero-stage 2 --dtype float64 --steps 2 --check "
             "--lesson fsdp=my_fsdp.py", _says(
                 "gradient norms: max relative diff 1.00e+00", "the gradients after the sync, rank 1: output.weight",
                 "2× the expected (2 = dp·cp)", "made by: reduce_scatter over ranks [0, 1]", "my_fsdp.py"), fails=True,
             edits=(("fsdp.py -> my_fsdp.py", "            out.div_(u.divide_by)  # gloo has no ReduceOp.AVG: sum, "
                     "then divide\n", ""),)),
    Exercise("torchrun --nproc_per_node 2 train.py --pp 2 --dtype float64 --steps 2 --check "
             "--lesson pipeline=my_pipeline.py", _says(
                 "the gradients after backward, rank 1: output.weight", "2× the expected (2 = m, the micro-batches)"),
             fails=True, edits=(("pipeline.py -> my_pipeline.py", "outputs[key] = [out / m if last else out]",
                                 "outputs[key] = [out if last else out]"),)),
    Exercise("torchrun --nproc_per_node 2 train.py --tp 2 --steps 2 --check --check-tolerance 1e-9", _rounding),
]
