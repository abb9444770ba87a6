"""Write it yourself: each lesson's core as an exercise you implement, graded by the one-process oracle and the formulas.

    python -m lab.exercises list                  the exercises in order, with what you started and passed
    python -m lab.exercises start NAME [--over]   yours/<lesson>.py: the lesson with that core blanked
    python -m lab.exercises grade NAME            that core's checks on YOUR version: PASS / FAIL with a diagnosis
    python -m lab.exercises compare NAME          a diff of your core against the reference's
    python -m lab.exercises solution NAME         the reference core

`start` copies the lesson into the folder yours/ (git ignores it) with the exercise's core — a function, a method
or two, two assignments — replaced by its signature, its docstring, the task, a hint and `raise
NotImplementedError("not implemented yet: exercise NAME ...")`; a second exercise of the same lesson blanks its core
inside your own file, keeping what you wrote; the lessons at the root are never written (lab/workbook.py). `grade`
loads yours/<lesson>.py under a private name and puts your core in place of the reference's inside the grading ranks
only, then runs that core's checks: equality with one process in float64 on 1, 2 and 4 ranks, on every rank, and the
formula the core exists for (lab/grader.py runs them; each exercise's checks are one block of lab/exercise_checks.py).
Collectives that do not match across ranks stop within seconds with each rank's collective named
(lab/collective_watch.py).
"""
from __future__ import annotations

import argparse
import sys

from lab.workbook import Refusal, compare, listing, solution, start


# ---- the command line --------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.exercises", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the exercises in order, with your progress")
    s = sub.add_parser("start", help="write yours/<lesson>.py with the core blanked")
    s.add_argument("name")
    s.add_argument("--over", action="store_true", help="start over: blank the core again (your attempt is saved)")
    for cmd, what in (("grade", "run the core's checks on your version"), ("compare", "diff yours against the "
                      "reference"), ("solution", "print the reference core")):
        sub.add_parser(cmd, help=what).add_argument("name")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print(listing())
        elif args.command == "start":
            print(start(args.name, args.over))
        elif args.command == "compare":
            print(compare(args.name))
        elif args.command == "solution":
            print(solution(args.name))
        else:
            from lab import grader
            return 0 if grader.grade(args.name) else 1
    except Refusal as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
