"""The repository's shape: the root holds exactly the course, everything else is one package, and imports
run one way (read from every module's source with `ast`, imports inside functions included).

    the package's model, data, instruments, launch, collective_watch  <-  mesh  <-  the lessons  <-  the package's checkpoint
        <-  train
        <-  the rest of the package (demos, references, measurements)  <-  tests and notebooks

A lesson imports another lesson only where its idea builds on it (LESSON_BUILDS_ON). The one import that
may point up is a lesson's `if __name__ == "__main__":` hand-over to its own demo (the file then runs as
a script, not as the module), and that block is at most three lines.
"""
import ast
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "lab"
LESSONS = ("ddp", "fsdp", "hsdp", "tensor_parallel", "pipeline", "ring_attention", "expert_parallel")
COURSE = ("mesh", *LESSONS, "train")
BASE = tuple(f"{PACKAGE}.{m}" for m in ("model", "data", "instruments", "launch", "collective_watch"))
PACKAGES = {PACKAGE}  # (a subpackage added under lab/ goes here too)
LESSON_BUILDS_ON = {"hsdp": {"fsdp"},            # hybrid sharding is ZeRO with one more all-reduce
                    "expert_parallel": {"ddp"}}  # expert gradients: lesson 1's average, over their own group
# What the course may take from the package: the shared model and data (and mesh.py the launcher's free
# port and the collective guard behind `agree`; train.py the watch's labels and flags). Instruments, reports and
# demos attach from outside, so no lesson imports them.
COURSE_USES = {"mesh": {"lab.launch", "lab.collective_watch"}, **{m: {"lab.model", "lab.data"} for m in LESSONS},
               "train": {"lab.model", "lab.data", "lab.checkpoint", "lab.collective_watch"}}
# What train.py keeps out of the composition, in the package: checkpoint files (their format and safety), built
# on fsdp.py's slices (their pieces any layout can load), used by train.py alone; and the Hugging Face conversion those files use (config.json and
# the tensors' names: lab/hf.py imports only the model).
BESIDE_TRAIN = (f"{PACKAGE}.checkpoint", f"{PACKAGE}.hf")
TOP_LEVEL = {"README.md", "requirements.txt", "pytest.ini", ".gitignore", ".ci", "tests", "notebooks", PACKAGE,
             *(m + ".py" for m in COURSE)}


def layer(module: str) -> int:
    if module in BASE:
        return 0
    if module == "mesh":
        return 1
    if module in LESSONS:
        return 2
    if module in BESIDE_TRAIN:
        return 2.5
    if module == "train":
        return 3
    return 4  # the rest of the package


def sources() -> dict:
    """{module name: source} of the course files at the root and every module of the package (at any depth)."""
    out = {m: open(os.path.join(ROOT, m + ".py")).read() for m in COURSE}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
        for f in sorted(f for f in files if f.endswith(".py")):
            out[package if f == "__init__.py" else f"{package}.{f[:-3]}"] = open(os.path.join(folder, f)).read()
    return out


def _is_main_block(node) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.dump(node.test)


def imports(source: str, known, module: str = "") -> tuple[set, set]:
    """(imports of known modules anywhere but a `__main__` block, those inside one); relative imports are
    resolved against `module`'s package."""
    body, main = set(), set()

    def visit(node, into):
        if isinstance(node, ast.Import):
            into.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from .x import y
                parent = module.split(".")[:len(module.split(".")) - node.level + (module in PACKAGES)]
                base = ".".join(parent + ([node.module] if node.module else []))
            into.update({base} & set(known))
            into.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
        for child in ast.iter_child_nodes(node):
            visit(child, main if _is_main_block(child) else into)
    visit(ast.parse(source), body)
    return body - PACKAGES, main - PACKAGES


def problems(srcs: dict) -> list[str]:
    """Every import that points the wrong way, every lesson-to-lesson import not in LESSON_BUILDS_ON, every
    `__main__` block that does more than hand over to its own demo, and every import cycle."""
    found, graph = [], {}
    for mod, src in srcs.items():
        body, main = imports(src, srcs, mod)
        if mod not in COURSE:  # only a lesson's hand-over is exempt: elsewhere a __main__ block imports as any code
            body, main = body | main, set()
        graph[mod] = body - {mod}
        for dep in sorted(graph[mod]):
            if layer(dep) > layer(mod):
                found.append(f"{mod} imports {dep}: an upward import (imports run one way)")
            elif layer(mod) == layer(dep) == 2 and dep not in LESSON_BUILDS_ON.get(mod, ()):
                found.append(f"{mod} imports the lesson {dep}: a lesson imports another only where its idea "
                             f"builds on it (add it to LESSON_BUILDS_ON with the reason, or move the code)")
            elif mod in COURSE and layer(dep) == 0 and dep not in COURSE_USES[mod]:
                found.append(f"{mod} imports {dep}: a lesson takes only the shared model and data from the "
                             f"package; what measures or reports attaches from outside")
        if mod in COURSE:
            own = f"{PACKAGE}.{mod}_demo"
            if main - {own}:
                found.append(f"{mod}'s __main__ block imports {sorted(main - {own})}: it may hand over only to {own}")
            blocks = [n for n in ast.parse(src).body if _is_main_block(n)]
            lines = sum(n.end_lineno - n.lineno for n in blocks)  # the lines under `if __name__ ...:`
            if len(blocks) != 1 or lines > 3:
                found.append(f"{mod}: its __main__ block must hand over to {own} in at most three lines")
    seen = set()

    def walk(mod, path):
        for dep in sorted(graph.get(mod, ())):
            if dep in path:
                cycle = path[path.index(dep):] + [dep]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    found.append("import cycle: " + " -> ".join(cycle))
            else:
                walk(dep, path + [dep])
    for mod in sorted(graph):
        walk(mod, [mod])
    return found


def test_the_root_holds_exactly_the_course_and_one_package():
    if os.path.isdir(os.path.join(ROOT, ".git")):  # what the repository tracks at its top level
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        top = {path.split("/")[0] for path in tracked.splitlines()}
        assert top == TOP_LEVEL, f"the root tracks {sorted(top - TOP_LEVEL)} too, lacks {sorted(TOP_LEVEL - top)}"
    py = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
    extra = sorted(set(py) - set(COURSE))
    assert py == sorted(COURSE), f"the root's .py files must be exactly the course: extra {extra}"
    packages = [d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))]
    assert packages == [PACKAGE], f"one package holds everything else, found {packages}"
    for name in ("README.md", "requirements.txt", "pytest.ini", "tests", "notebooks", ".ci"):
        assert os.path.exists(os.path.join(ROOT, name)), name


def test_imports_run_one_way_without_cycles():
    found = problems(sources())
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module, line, what", [
    ("mesh", "import ddp", "upward import"),                              # mesh below the lessons
    ("lab.model", "from mesh import Mesh", "upward import"),              # the model below mesh
    ("ddp", "from lab.report import print0", "upward import"),            # a lesson printing through a demo tool
    ("fsdp", "from lab.instruments import CommCounter", "takes only the shared model"),  # counting inside
    ("lab.model", "from . import report", "upward import"),               # relative imports count too
    ("tensor_parallel", "import pipeline", "imports the lesson pipeline"),  # no idea of its own builds on it
    ("lab.model", "from lab.instruments import CommCounter", "import cycle"),   # with the line below
])
def test_the_check_catches_an_upward_import_and_a_cycle(module, line, what):
    """The check itself can fail: one added line (inside a function: those count too) is enough."""
    srcs = sources()
    srcs[module] += f"\n\ndef _added():\n    {line}\n"
    if what == "import cycle":
        srcs["lab.instruments"] += "\n\ndef _added_too():\n    from lab.model import build_model\n"
    assert any(what in p for p in problems(srcs)), problems(srcs)


def test_a_main_block_only_hands_over():
    srcs = sources()
    srcs["fsdp"] += "\n\nif __name__ == '__main__':\n    from lab.report import print0\n    print0('hi')\n"
    assert any("fsdp" in p and "__main__" in p for p in problems(srcs))
    srcs = sources()  # a package module's __main__ block imports like any code
    srcs["lab.model"] += "\n\nif __name__ == '__main__':\n    import train\n"
    assert any("lab.model imports train" in p for p in problems(srcs))


@pytest.mark.parametrize("lesson", COURSE)
def test_a_lesson_opens_with_its_docstring_and_holds_no_demo(lesson):
    """The lesson is its algorithm: a docstring first, and above the hand-over no printing, argument
    parsing or timing (train.py parses its command line: that is part of the composition)."""
    tree = ast.parse(open(os.path.join(ROOT, lesson + ".py")).read())
    assert ast.get_docstring(tree) and isinstance(tree.body[0], ast.Expr), f"{lesson}.py opens with its docstring"
    calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
             for n in ast.walk(ast.Module([n for n in tree.body if not _is_main_block(n)], []))
             if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
    banned = {"print", "perf_counter"} | ({"ArgumentParser"} if lesson != "train" else set())
    assert not calls & banned, f"{lesson}.py calls {sorted(calls & banned)} above its __main__ block"
