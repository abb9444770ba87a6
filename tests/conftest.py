import os
import sys

# The lessons are flat files at the repository root; the harness lives beside the tests.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

# The planner keeps its probes and played schedules on disk (lab.plan_time.cache_dir; deterministic counts, named by
# the code's digest): for the suite, in one directory of its own, not the home directory — set here, before any
# test imports lab.launch, so that the ranks the tests start fork from one server (a test that changed the variable
# would send its ranks to `spawn`, each importing torch afresh). A test of the cache itself sets its own.
if "PLAN_TIME_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["PLAN_TIME_CACHE"] = tempfile.mkdtemp(prefix="course-plan-cache-")
    atexit.register(shutil.rmtree, os.environ["PLAN_TIME_CACHE"], True)
