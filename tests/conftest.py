import contextlib
import fcntl
import os
import sys
import tempfile

import pytest

# The lessons are flat files at the repository root; the harness lives beside the tests.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

# One directory for the whole session, its workers' included (they inherit the variable), removed at its end: the
# planner's probes and played schedules (lab.plan_time.cache_dir: deterministic counts, named by the code's digest),
# not the home directory, and the workers' lock files (below). Set here, before any test imports lab.launch, so that
# the ranks the tests start fork from one server (a test that changed the variable would send its ranks to `spawn`,
# each importing torch afresh). A test of the cache itself sets its own.
if "COURSE_TEST_DIR" not in os.environ:
    import atexit
    import shutil
    os.environ["COURSE_TEST_DIR"] = tempfile.mkdtemp(prefix="course-tests-")
    atexit.register(shutil.rmtree, os.environ["COURSE_TEST_DIR"], True)
os.environ.setdefault("PLAN_TIME_CACHE", os.path.join(os.environ["COURSE_TEST_DIR"], "plan_time"))


# ---- two workers: the machine shared, or taken alone by a test that reads timings ---------------------------------
# The README's command runs the suite on two pytest-xdist workers, each taking whole test files (below): a
# test's ranks leave a core idle much of the time (one rank waits on another, a single process prices or plots), and
# the other worker's test fills it. A test whose assertions read timings (marked `quiet`: a measured step against
# its prediction, what overlapped what) would measure the other worker's load: it takes the machine alone — it waits
# for the other worker's test to end, and that worker waits for it. A module that runs its jobs in threads of its own
# across its tests (marked `background`: the README's exercises, the notebooks) takes the machine per job instead
# (the `machine` fixture). Outside a worker (plain `pytest`, or a pytest that a test starts) nothing is locked.

_LOCKS: list = []   # in a worker: the machine's lock file and its turnstile's

# Files that share one spawned group of ranks (a cache in test_fsdp: every configuration of these three on P ranks,
# run once per process) go to one worker, as one unit; every other file is a unit of its own (--dist loadgroup)
SAME_WORKER = {"test_awkward_fsdp.py": "test_fsdp.py", "test_hsdp.py": "test_fsdp.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "quiet: the test reads timings: nothing else runs beside it")
    config.addinivalue_line("markers", "background: the module's jobs run in threads and take the machine each")
    if hasattr(config, "workerinput"):   # a pytest-xdist worker
        _LOCKS[:] = [os.path.join(os.environ["COURSE_TEST_DIR"], name) for name in ("machine.lock", "turnstile.lock")]


@pytest.hookimpl(tryfirst=True)   # before xdist's own, which reads the group into each test's id
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "loadgroup", False):   # (--dist loadgroup, as xdist's workers see it)
        return
    for item in items:
        name = os.path.basename(str(item.fspath))
        item.add_marker(pytest.mark.xdist_group(SAME_WORKER.get(name, name)))


@contextlib.contextmanager
def machine(alone: bool = False):
    """Held while a test (or a background job) runs: shared with the other worker's, or alone."""
    if not _LOCKS:
        yield
        return
    with open(_LOCKS[0], "a") as held, open(_LOCKS[1], "a") as turnstile:
        # one taker at a time passes the turnstile: one that waits to be alone holds it, so the other worker's next
        # test queues behind it instead of slipping in beside the one still running
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield   # (the lock goes with the file)


@pytest.fixture(scope="session", name="machine")
def machine_fixture():
    return machine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around a test's setup, call and teardown (a module's fixtures included)."""
    if item.get_closest_marker("background"):
        yield
        return
    with machine(alone=item.get_closest_marker("quiet") is not None):
        yield
