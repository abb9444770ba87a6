"""The exercises of "write it yourself" and the learner's workbook, the folder yours/ (git ignores it).

    EXERCISES             each lesson's core to write: its name, lesson, the function(s) or method(s), task and hint
    blank(text, ex)       a lesson's source with the exercise's core blanked (ast): signature and docstring kept, the
                          task and hint as comments, raise NotImplementedError("not implemented yet: exercise NAME")
    start / compare / solution / listing     what `python -m lab.exercises` does with yours/ (lab/exercises.py);
                          start shows the blanked core to write, before the learner reads the lesson's

`start` copies the lesson into yours/ with the core blanked; a second exercise of the same lesson blanks its core
inside the learner's own file, keeping what they wrote. The lessons at the root are never written: the reference is
always there to compare with. Grading is lab/grader.py's, with the checks of lab/exercise_checks.py.
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import json
import os
import textwrap
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKSPACE = "yours"


@dataclass(frozen=True)
class Exercise:
    """One core to write. cores: qualified names in the lesson file (a function, Class.method, or a module-level
    NAME = ... assignment); task and hint: what the learner reads in the blanked file and in `list`."""
    name: str
    number: int      # the lesson's number
    lesson: str      # its module (the file at the root)
    cores: tuple
    task: str
    hint: str
    notes: tuple = ()  # (qualname, what it does): the docstring of a core that has none, in a many-core exercise

    @property
    def file(self) -> str:
        return self.lesson + ".py"


EXERCISES = [
    Exercise("rows", 0, "mesh", ("rows_along",),
             "Every group along the axes `along` of a grid of ranks: one list of ranks per setting of the other axes, "
             "its members in grid order, the groups in grid order of the other axes. Mesh builds every process group "
             "of the course from these lists.",
             "Reorder the grid's axes so that the `along` axes come last, the others keeping their order in front; then "
             "read the grid as rows of as many ranks as the `along` axes hold together: each row is one group. Return "
             "plain Python lists of ints, the same on every rank."),
    Exercise("average", 1, "ddp", ("average_gradients",),
             "After loss.backward(): every gradient of `params` summed over `group` in ONE flat all-reduce and divided "
             "by `divide_by` (default: the group's size), so every rank holds g = (1/P)·Σ_r g_r. A parameter without "
             "a gradient on this rank sends zeros (every rank must hand over the same sizes).",
             "Turn `group` into a process group as the other lessons do (mesh.py has the helper). Skip the parameters "
             "that need no gradient; give those without one a zero gradient of their own shape and dtype. Then sum "
             "every gradient in ONE collective over one flat buffer (mesh.py has a helper that flattens, sums and "
             "copies back), and divide: gloo cannot average. `params` may be an iterator: read it once."),
    Exercise("bucket", 1, "ddp", ("BucketedDDP._launch_in_order",),
             "Called by _on_grad_ready each time a bucket's last gradient has arrived (and once more at the end of "
             "backward): launch, in bucket order, every bucket from self._next on that is ready — divide its flat "
             "buffer by bucket.divide_by, start its all-reduce over bucket.group ASYNCHRONOUSLY (keep the work in "
             "bucket.work; _finish_backward waits for it) — and stop at the first bucket not ready yet.",
             "Walk the buckets from self._next as long as the bucket there is complete: divide its flat buffer by the "
             "bucket's own divisor, start its sum over the bucket's own group WITHOUT waiting for it (keep what the "
             "collective returns on the bucket: the end of backward waits), move self._next on. Stop at the first "
             "bucket not complete: ranks pair collectives by the order they are issued. A group of one needs no "
             "collective, but still its division."),
    Exercise("zero_step", 2, "fsdp", ("zero_step",),
             "One ZeRO step after loss.backward(), for every FlatParameter f of `flats`: reduce-scatter its packed "
             "gradient so this rank receives the sum of ITS slice only, divide by the group's size, leave only that "
             "slice's gradient (f.shard.grad; the full parameters' .grad None), let `optimizer` step the slices, then "
             "all-gather the new slices into f.buf — unless f.buf was freed (stage 3: the next use gathers).",
             "For each unit: pack its gradients into one flat buffer, sum it across the group so that this rank "
             "receives its own slice alone, divide by the group's size, keep that as the shard's gradient and none on "
             "the whole parameters. Step once, after every unit. Then gather every rank's new slice back into each "
             "buffer that still has its bytes; a freed one waits for its next use. FlatParameter has a method for each "
             "move; the group's rank and size are its own, not the world's."),
    Exercise("gather_when_used", 2, "fsdp", ("gather_when_used",),
             "ZeRO-3 on one module: register hooks so that `flat` is gathered (flat.unshard()) right before the "
             "module's forward and again right before its backward, and freed (flat.free()) right after each — the "
             "module holds whole parameters only while it runs.",
             "Four module hooks: gather before the forward and before the backward, free after each. A hook "
             "receives arguments you can ignore, and what it returns may replace the module's input or output: let "
             "it return nothing. Gathering a freed unit first gives its buffer its bytes back."),
    Exercise("across_replicas", 3, "hsdp", ("across_replicas",),
             "HSDP's one addition to ZeRO: return the function fsdp's after_reduce seam calls on every gradient shard "
             "[n] (already summed over my shard group by the reduce-scatter) and on the used-flags: sum it, in place, "
             "across the replicas that hold the same shard. shard_hybrid divides by S·R afterwards.",
             "Return a function of one tensor that sums it, in place, over the replicate group: the seam ignores what "
             "it returns, and calls it on the gradient shards and on the used-flags alike."),
    Exercise("f_and_g", 4, "tensor_parallel", ("_all_reduce", "F_TP", "G_TP"),
             "Megatron's conjugate operators as (forward, backward) pairs of functions(x, group) for _Conjugate: f at "
             "the entry of a column/row pair — every rank uses all of x, so x's gradient is the SUM of the ranks' — "
             "and g at its exit — the ranks' partial outputs summed. And _all_reduce(x, group), the sum over the "
             "group of a tensor autograd owns.",
             "f enters a pair: its forward leaves x as it is, its backward sums the gradient over the group. g exits a "
             "pair: its forward sums the ranks' partial outputs, its backward leaves the gradient as it is. The sum "
             "works in place: sum a contiguous copy of x and return that, never autograd's own tensor.",
             (("_all_reduce", "x summed over the group's ranks, for a tensor autograd owns: all_reduce works in place, "
               "so it runs on a contiguous clone of x, which is returned."),)),
    Exercise("pair", 4, "tensor_parallel", ("ColumnParallelLinear.forward", "RowParallelLinear.forward"),
             "The column/row pair: the column-parallel linear enters the pair (f, or sequence parallel's all-gather) "
             "unless its input_op is None, then multiplies by its rows of W: my F/t output features. The row-parallel "
             "linear multiplies its input features by its columns of W — a partial sum of y — and exits the pair "
             "(g, or sequence parallel's reduce-scatter).",
             "Column: enter the pair first, unless input_op says the caller did (under sequence parallel the entry "
             "gathers the sequence), then multiply by this rank's rows of the weight with the class's own swappable "
             "matmul. Row: multiply by this rank's columns — a partial result — and leave the pair (a sum, or under "
             "sequence parallel a reduce-scatter). The lesson has a function for entering and one for leaving.",
             (("ColumnParallelLinear.forward", "x [B, S, H] (or [B, S/t, H] under sequence parallel) -> my F/t output "
               "features [B, S, F/t]: enter the pair unless input_op is None, then x @ W[my rows].T."),
              ("RowParallelLinear.forward", "x [B, S, F/t], my input features -> y [B, S, H] (or [B, S/t, H]): the "
               "partial product with my columns of W, summed over the ranks as it leaves the pair."))),
    Exercise("one_f_one_b", 5, "pipeline", ("one_f_one_b_plain",),
             "One 1F1B step of this rank's stage of p: warm-up min(p-r-1, m) forwards, then a forward and a backward "
             "in turn, then the cool-down backwards; each micro-batch's loss scaled by 1/m; activations sent to the "
             "next stage and gradients back to the previous one. Returns the mean loss on the last stage, None "
             "elsewhere, and leaves the batch's gradients in .grad.",
             "Keep the micro-batches in flight in first-in first-out lists. Warm up with as many forwards as there are "
             "stages after this one (at most m), then alternate one forward and one backward of the OLDEST micro-batch, "
             "then drain the backwards. A received activation must require grad, or its gradient cannot go back. Post "
             "each send together with the receive the next step needs, then wait for both; the neighbours are global "
             "ranks (the PipeGroup knows them)."),
    Exercise("merge", 6, "ring_attention", ("merge",),
             "Fold a block's attention (block_out [.., D], block_lse [..]) into the running (out, lse): the softmax over "
             "both blocks' keys. lse' = log(e^lse + e^lse_b), out' = (e^lse·out + e^lse_b·out_b)/(e^lse + e^lse_b), "
             "written so that nothing overflows when the scores are large. (None, None) is the empty start.",
             "Write each block's share of the softmax as a sigmoid of the difference of the two lse's, and the new lse "
             "with a log-sigmoid: neither takes the exponential of a large number. A weight per query row must "
             "broadcast over D. The empty start returns the block itself."),
    Exercise("ring", 6, "ring_attention", ("RingAttention.forward",),
             "Ring attention's forward: for each step t of ring_schedule (the block of rank (r−t) mod cp in hand), "
             "start passing the k, v block in hand to the next rank (RingPass) unless it is the last step, fold every "
             "pair (i, j, diagonal) of my query chunk i against the block's key chunk j into outs[i], lses[i] with "
             "merge(.., *block_forward(..)), then take the block that arrived. Work in at least fp32; save "
             "(q, k, v, out, lse) and group, layout, causal on ctx for the backward; return out in q's dtype.",
             "Split q into the chunks the layout gives a rank (zigzag: two). At each step of the ring's schedule, first "
             "start passing the block in hand to the next rank (not after the last step), then fold every pair the "
             "schedule lists into that chunk's running out and lse, then take the block that arrived. Compute in at "
             "least fp32 while the block travels in its own dtype; the rank is the group's."),
    Exercise("all_to_all", 7, "expert_parallel", ("AllToAll.forward", "AllToAll.backward"),
             "The differentiable all-to-all: forward sends rows x[sum(in_splits[:j]) : +in_splits[j]] to rank j and "
             "returns what arrives, out_splits[i] rows from rank i. Its backward is the inverse permutation: each "
             "row's gradient goes back to where the row came from.",
             "The forward is one exchange of rows, sized by the two split lists; keep on ctx what the backward needs "
             "(lists are not tensors). The gradient of a permutation is the inverse permutation: the same exchange "
             "with the two lists swapped, over the same group. Every argument gets a gradient or None.",
             (("AllToAll.forward", "Rows x[sum(in_splits[:j]) : +in_splits[j]] to rank j; out_splits[i] rows arrive from "
               "rank i, returned in rank order. Keep on ctx what the backward needs."),
              ("AllToAll.backward", "Each row's gradient back to the rank the row came from: the forward's exchange "
               "with the splits swapped. None for the other arguments."))),
    Exercise("dispatch_combine", 7, "expert_parallel", ("ExpertParallelMoE.dispatch_combine",),
             "The expert-parallel MoE layer on tokens x [T, H]: route (self.route), the aux loss (group_aux_loss), "
             "exchange the counts (exchange_counts: keep_send [E], keep_recv [ep, E/ep]), sort the assignments by "
             "expert keeping the first keep_send[e] of each, dispatch their rows by all-to-all, run my experts "
             "(self.experts on rows grouped by expert), send the results home by the reverse all-to-all, weight them "
             "by the router and sum them into their tokens. Set self.aux_loss, self.tokens_per_expert, self.dropped.",
             "Route; count the assignments per expert and agree on the counts before any row moves; order the "
             "assignments by expert, keeping token order within one, and keep each expert's accepted first ones; "
             "send their rows to the experts' owners; run my experts, one group of rows each; send the results back "
             "the way they came; weight each by the router and ADD it into its token (a token has k of them)."),
]
BY_NAME = {e.name: e for e in EXERCISES}


class Refusal(ValueError):
    """Bad input: one line that names the fix."""


def exercise(name: str) -> Exercise:
    if name not in BY_NAME:
        close = difflib.get_close_matches(name, BY_NAME, n=1)
        raise Refusal(f"no exercise {name!r}" + (f" — did you mean {close[0]!r}?" if close else "")
                      + f" The exercises: {', '.join(BY_NAME)} (python -m lab.exercises list)")
    return BY_NAME[name]


# ---- finding and blanking a core in a file (ast) -------------------------------------------------------------------

def find(tree: ast.Module, qualname: str):
    """The ast node of `qualname` — a function, Class.method, or a module-level NAME = ... — or None."""
    body, node = tree.body, None
    for part in qualname.split("."):
        node = None
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part:
                node = n
            elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == part for t in n.targets):
                node = n
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def _first_line(node) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def core_source(text: str, qualname: str) -> str | None:
    """The source lines of a core (decorators included), dedented; None if the file has no such name."""
    node = find(ast.parse(text), qualname)
    if node is None:
        return None
    lines = text.splitlines()[_first_line(node) - 1:node.end_lineno]
    return textwrap.dedent("\n".join(lines)) + "\n"


def core_lines(text: str, qualname: str) -> tuple[int, int] | None:
    """(first, last) line of a core in `text`, 1-based, decorators included; None if absent."""
    node = find(ast.parse(text), qualname)
    return None if node is None else (_first_line(node), node.end_lineno)


def marker(ex: Exercise) -> str:
    return f"not implemented yet: exercise {ex.name}"


def is_blank(text: str, ex: Exercise, qualname: str) -> bool:
    src = core_source(text, qualname)
    return src is not None and (marker(ex) in src or f"_exercise_{ex.name}" in src)


def _comment(text: str, indent: str, first: str) -> list[str]:
    return [indent + line for line in textwrap.wrap(text, 104, initial_indent=first, subsequent_indent="#   ")]


def _raise_line(ex: Exercise, qualname: str, indent: str) -> str:
    return (f'{indent}raise NotImplementedError("{marker(ex)} — write {qualname} in {WORKSPACE}/{ex.file}, then: '
            f'python -m lab.exercises grade {ex.name}")')


def blank(text: str, ex: Exercise) -> str:
    """`text` (a lesson's source) with every core of `ex` replaced by its blank: signature and docstring kept, the
    task and the hint as comments, and the NotImplementedError."""
    tree, lines = ast.parse(text), text.splitlines()
    edits = []  # (first line, last line, new lines), 1-based inclusive
    stub = f"_exercise_{ex.name}"
    stub_added = False
    for qualname in ex.cores:
        node = find(tree, qualname)
        if node is None:
            raise Refusal(f"{qualname} is not in this file any more: restore it (python -m lab.exercises solution "
                          f"{ex.name} prints it) or start the lesson's exercises afresh")
        if isinstance(node, ast.Assign):  # a module-level NAME = ...: a stand-in that raises when called
            name, new = qualname, []
            if not stub_added:
                new += [f"def {stub}(*args):  # a stand-in: replace the assignments below with your own"]
                new += _comment(ex.task, "    ", "# exercise " + ex.name + ": ")
                new += _comment(ex.hint, "    ", "# hint: ")
                new += [_raise_line(ex, " and ".join(c for c in ex.cores if find(tree, c) and
                                                     isinstance(find(tree, c), ast.Assign)), "    "), "", ""]
                stub_added = True
            if new:  # the stand-in goes above the comments that introduce the assignment
                above = node.lineno
                while above > 1 and lines[above - 2].strip().startswith("#"):
                    above -= 1
                edits.append((above, above - 1, new))
            edits.append((node.lineno, node.end_lineno,
                          [f"{name} = ({stub}, {stub})  # exercise {ex.name}: write (forward, backward)"]))
            continue
        body = node.body
        indent = " " * body[0].col_offset
        doc = ast.get_docstring(node, clean=False)
        has_doc = doc is not None and isinstance(body[0], ast.Expr)
        start = body[0].end_lineno + 1 if has_doc else _header_end(lines, body[0].lineno) + 1
        note = dict(ex.notes).get(qualname, ex.task)
        new = [] if has_doc else [f'{indent}"""{_docstring(note, indent)}"""']
        new += _comment(ex.task, indent, f"# exercise {ex.name}: ") if has_doc or note != ex.task else \
            [f"{indent}# exercise {ex.name}"]
        new += _comment(ex.hint, indent, "# hint: ")
        new.append(_raise_line(ex, qualname, indent))
        edits.append((start, node.end_lineno, new))
    for first, last, new in sorted(edits, reverse=True):
        lines[first - 1:last] = new
    out = "\n".join(lines) + "\n"
    ast.parse(out)  # the blanked file still parses
    return out


def _header_end(lines, body_line) -> int:
    """The last line of a def's header: above its first statement, skipping comment and blank lines."""
    i = body_line - 1
    while i > 1 and (not lines[i - 1].strip() or lines[i - 1].strip().startswith("#")):
        i -= 1
    return i


def _docstring(text: str, indent: str) -> str:
    return "\n".join(textwrap.wrap(text, 104 - len(indent), subsequent_indent=indent)) + f"\n{indent}"


def replace_core(text: str, qualname: str, source: str) -> str:
    """`text` with the core `qualname` replaced by `source` (a whole def or assignment, dedented) — to restore a core
    or, in the tests, to write an attempt."""
    node = find(ast.parse(text), qualname)
    lines = text.splitlines()
    indent = lines[node.lineno - 1][:len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]
    lines[_first_line(node) - 1:node.end_lineno] = textwrap.indent(source, indent).rstrip("\n").splitlines()
    return "\n".join(lines) + "\n"


# ---- the workspace --------------------------------------------------------------------------------------------------

def workspace(root: str = ROOT) -> str:
    return os.path.join(root, WORKSPACE)


def yours(ex: Exercise, root: str = ROOT) -> str:
    return os.path.join(workspace(root), ex.file)


def _progress_path(root):
    return os.path.join(workspace(root), ".progress.json")


def progress(root: str = ROOT) -> dict:
    try:
        with open(_progress_path(root)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"started": [], "passed": {}}


def _save_progress(p, root):
    with open(_progress_path(root), "w") as f:
        json.dump(p, f, indent=1)


def fingerprint(text: str, ex: Exercise) -> str:
    return hashlib.sha256("".join(core_source(text, q) or "" for q in ex.cores).encode()).hexdigest()[:16]


def reference_text(ex: Exercise, root: str = ROOT) -> str:
    with open(os.path.join(root, ex.file)) as f:
        return f.read()


def start(name: str, over: bool = False, root: str = ROOT) -> str:
    """Write yours/<lesson>.py with the exercise's core blanked; returns what to tell the learner."""
    ex = exercise(name)
    path, p = yours(ex, root), progress(root)
    os.makedirs(workspace(root), exist_ok=True)
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
        try:
            ast.parse(text)
        except SyntaxError as e:
            raise Refusal(f"{WORKSPACE}/{ex.file} does not parse (line {e.lineno}: {e.msg}): fix it first, or delete "
                          f"it to start the lesson's exercises afresh") from None
        if name in p["started"] and not over:
            raise Refusal(f"exercise {name} is started already in {WORKSPACE}/{ex.file}: grade it (python -m "
                          f"lab.exercises grade {name}), or start it over with --over (its core is blanked again; "
                          f"the rest of your file is kept, and your attempt saved beside it)")
        if over:
            backup = os.path.join(workspace(root), f".{ex.lesson}.{name}.before-over.py")
            with open(backup, "w") as f:
                f.write(text)
        base, where = text, "your own file, which keeps your earlier work"
    else:
        base, where, backup = reference_text(ex, root), f"a copy of {ex.file}", None
    text = blank(base, ex)
    with open(path, "w") as f:
        f.write(text)
    if name not in p["started"]:
        p["started"].append(name)
    p["passed"].pop(name, None)
    _save_progress(p, root)
    cores = ", ".join(ex.cores)
    return "\n".join([
        f"exercise {name} (lesson {ex.number}, {ex.file}): {cores} blanked in {WORKSPACE}/{ex.file} ({where}).",
        f"Write it there BEFORE you read it in {ex.file}: the lesson's file holds this very core, the answer. What "
        f"you write:", "", *blanked_cores(text, ex), "",
        f"Grade it:             python -m lab.exercises grade {name}",
        f"Stuck? The hint is in the comments above; when it passes (or if you give up), python -m lab.exercises "
        f"compare {name} shows your core beside the reference.",
    ] + ([f"(your previous attempt: {os.path.relpath(backup, root)})"] if over and backup else []))


def blanked_cores(text: str, ex: Exercise) -> list[str]:
    """What the learner writes, as `start` shows it: each blanked core of `ex` in `text` with its place in the file
    (a core written as assignments with the stand-in function above them)."""
    names = list(ex.cores)
    if any(isinstance(find(ast.parse(text), q), ast.Assign) for q in names):
        names.append(f"_exercise_{ex.name}")
    out = []
    for first, q in sorted((core_lines(text, q)[0], q) for q in names):
        out += [f"{WORKSPACE}/{ex.file}, line {first}:"] + ["    " + line for line in core_source(text, q).splitlines()]
    return out


def learner_text(ex: Exercise, root: str = ROOT) -> str:
    p = progress(root)
    path = yours(ex, root)
    if not os.path.exists(path) or ex.name not in p["started"]:
        raise Refusal(f"exercise {ex.name} is not started: run python -m lab.exercises start {ex.name} "
                      f"(it writes {WORKSPACE}/{ex.file} with the core to write blanked)")
    with open(path) as f:
        return f.read()


def compare(name: str, root: str = ROOT) -> str:
    ex = exercise(name)
    text, ref = learner_text(ex, root), reference_text(ex, root)
    out = []
    for q in ex.cores:
        mine = core_source(text, q)
        if mine is not None:
            mine = _without_exercise_comments(mine, ex)
        if mine is None:
            out.append(f"{WORKSPACE}/{ex.file} has no {q} (python -m lab.exercises solution {name} prints it)")
            continue
        diff = list(difflib.unified_diff(core_source(ref, q).splitlines(), mine.splitlines(),
                                         f"reference {ex.file}: {q}", f"{WORKSPACE}/{ex.file}: {q}", lineterm=""))
        out += diff or [f"{q}: the same as the reference"]
    return "\n".join(out)


def _without_exercise_comments(src: str, ex: Exercise) -> str:
    """A core's source less the task and hint comments `start` wrote into it (they are no part of the code)."""
    out, inside = [], False
    for line in src.splitlines():
        s = line.strip()
        if s.startswith((f"# exercise {ex.name}", "# hint: ")):
            inside = True
            continue
        if inside and s.startswith("#   "):
            continue
        inside = False
        out.append(line)
    return "\n".join(out) + "\n"


def solution(name: str, root: str = ROOT) -> str:
    ex = exercise(name)
    ref = reference_text(ex, root)
    return "\n".join(f"# {ex.file}: {q}\n{core_source(ref, q)}" for q in ex.cores)


def listing(root: str = ROOT) -> str:
    p, out = progress(root), []
    for i, ex in enumerate(EXERCISES, 1):
        status = "not started"
        if ex.name in p["started"] and os.path.exists(yours(ex, root)):
            with open(yours(ex, root)) as f:
                text = f.read()
            status = "started"
            if p["passed"].get(ex.name) == fingerprint(text, ex):
                status = "passed"
            elif ex.name in p["passed"]:
                status = "passed, then edited"
        out.append(f"{i:2}. {ex.name:<17} lesson {ex.number}  {ex.file:<19} {status:<20} {', '.join(ex.cores)}")
    return "\n".join(out)


def record_pass(ex: Exercise, text: str, root: str = ROOT) -> None:
    p = progress(root)
    p["passed"][ex.name] = fingerprint(text, ex)
    _save_progress(p, root)
