"""A learner's changed lesson run in place of the course's: `train.py --lesson NAME=FILE`.

    torchrun --nproc_per_node 2 train.py --tp 2 --check --lesson tensor_parallel=yours/tensor_parallel.py

`FILE` (yours/ from `python -m lab.exercises start`, or any edited copy of a lesson) is loaded AS the lesson
`NAME`: it becomes sys.modules[NAME], and every name the course's modules bound to the old lesson (`import
tensor_parallel`, `from fsdp import Seams`) is pointed at the new one — the way the grader puts a core in
place (lab/grader.py's `patched`), here for the whole file. Everything that runs afterwards — train.py's
composition, the lessons that build on it, --check — uses the changed file; the lesson at the root is never
written. Leaving `lessons_in_place` puts every original back (the tests train many layouts in one process).

What may be changed: the lessons and mesh.py (train.py itself is the composition: edit a copy and run that).
The changed file is checked before any collective, on every rank alike: it must exist and import.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys

LESSONS = ("mesh", "ddp", "fsdp", "hsdp", "tensor_parallel", "pipeline", "ring_attention", "expert_parallel")


def parse(specs) -> list[tuple[str, str]]:
    """['NAME=FILE', ...] -> [(NAME, absolute FILE)]; raises ValueError naming every bad one and the fix."""
    out, bad = [], []
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or name not in LESSONS:
            bad.append(f"--lesson {spec!r}: give NAME=FILE with NAME one of {', '.join(LESSONS)}")
        elif not os.path.isfile(path):
            bad.append(f"--lesson {spec!r}: {path!r} is not a file (e.g. yours/{name}.py from "
                       f"`python -m lab.exercises start`, or an edited copy of {name}.py)")
        else:
            out.append((name, os.path.abspath(path)))
    if len({n for n, _ in out}) < len(out):
        bad.append("--lesson names a lesson twice: give each lesson at most one file")
    if bad:
        raise ValueError("invalid training layout:\n  - " + "\n  - ".join(bad))
    return out


def _course_modules():
    """The modules that may hold names bound to a lesson: the course's and the package's."""
    return [m for name, m in list(sys.modules.items()) if m is not None and (
        name in LESSONS or name == "train" or name.startswith("lab.") or name == "__main__")]


def _rebind(pairs) -> list:
    """In every course module, each global bound to an old object of `pairs` [(old, new)] (a module, or a function or
    class of it) now bound to the new one; returns the undo list [(module, name, old)]."""
    by_id, undo = {id(old): new for old, new in pairs}, []
    for m in _course_modules():
        for k, v in list(vars(m).items()):
            new = by_id.get(id(v))
            if new is not None and new is not v:
                setattr(m, k, new)
                undo.append((m, k, v))
    return undo


def _load(name: str, path: str):
    """`path` imported as the module `name` (sys.modules[name] is it while its code runs, as any import)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def lessons_in_place(specs):
    """Inside: each lesson of `specs` (['NAME=FILE']) is the file's. A file that fails to import raises ValueError
    naming it (every rank alike: nothing has communicated yet) and leaves the course as it was."""
    changes = parse(specs)
    saved, undo = {}, []
    try:
        for name, path in changes:
            old = importlib.import_module(name)
            saved[name] = old
            try:
                new = _load(name, path)
            except Exception as e:  # noqa: BLE001 - whatever the learner's file raises, said as one error
                raise ValueError(f"--lesson {name}={path}: the file does not import ({type(e).__name__}: {e})") \
                    from e
            pairs = [(old, new)] + [(v, getattr(new, k)) for k, v in vars(old).items()
                                    if getattr(v, "__module__", None) == name and hasattr(new, k)]
            undo += _rebind(pairs)
        yield [path for _, path in changes]
    finally:
        for m, k, v in reversed(undo):
            setattr(m, k, v)
        for name, old in saved.items():
            sys.modules[name] = old
