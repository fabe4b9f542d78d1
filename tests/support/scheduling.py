"""How the suite is split over pytest-xdist's processes (`make test` runs `-n 2`).

Most of a vLLM test's time is a start that keeps one core busy, so two tests at once use the machine's
two cores. A session fixture lives once per process, so the tests that share a costly one (a whole
workflow run, the SLURM cluster) run in one process, and so do a module's tests (its module fixtures).
A fixture says it is such a run with `@shared_run`; a test joins that run's unit by requesting the
fixture, directly or through another fixture (its fixture closure), and brings its module along. Each
unit, and every other module, goes to one process as a whole. (Not xdist's loadgroup: under pytest 9.2
its xdist_group marks no longer reach the scheduler.)

xdist's controller, which schedules, collects nothing: it sees node ids, not fixtures. So each test
process writes the unit of every node id it collected to a file in a directory the controller names in
its workerinput, before it reports its collection; the scheduler reads them once all have reported.
"""
import json
import os
import sys
from pathlib import Path

SESSION_CPUS = sorted(os.sched_getaffinity(0))  # imported by conftest, before pin_share takes this process's share
UNITS_KEY = "eaglenest_units_dir"  # the workerinput key of the directory of the units files

SHARED_RUNS: list[str] = []  # the fixtures declared with @shared_run, in declaration order (the order they run in)


def shared_run(fixture_function):
    """Declares a session fixture a costly run that its users share: every test that requests it,
    directly or through another fixture, runs in one process with the rest of its module. Goes below
    @pytest.fixture. The runs start in the order they are declared: declare the longest first."""
    SHARED_RUNS.append(fixture_function.__name__)
    return fixture_function


def schedule_units(items, shared=SHARED_RUNS) -> dict[str, str]:
    """Node id -> the unit its test is scheduled in: the shared run its module's tests request, else its
    module. A module whose tests request two shared runs makes them one unit, named for the first declared."""
    uses = {}  # module -> the shared runs its tests request
    for item in items:
        names = getattr(item, "fixturenames", ())
        uses.setdefault(item.nodeid.split("::", 1)[0], set()).update(run for run in shared if run in names)
    root = {run: run for run in shared}

    def find(run):
        while root[run] != run:
            run = root[run]
        return run

    for runs in uses.values():  # each unit's root stays its first-declared run
        roots = sorted({find(run) for run in runs}, key=shared.index)
        for other in roots[1:]:
            root[other] = roots[0]
    unit = {module: find(next(iter(runs))) if runs else module for module, runs in uses.items()}
    return {item.nodeid: unit[item.nodeid.split("::", 1)[0]] for item in items}


def schedule_order(items, units: dict[str, str], shared=SHARED_RUNS) -> None:
    """Sorts `items` in place into the order xdist hands out their units: the shared runs first, in their
    declared order, then the other units that start vLLM, then the rest, which fill the gaps at the end.
    Stable: a module's tests keep their order."""
    starts_vllm = {units[item.nodeid] for item in items if item.get_closest_marker("vllm")}

    def rank(item):
        unit = units[item.nodeid]
        return (0, shared.index(unit)) if unit in shared else ((1 if unit in starts_vllm else 2), 0)

    items.sort(key=rank)


def write_units(units_dir, worker: str, units: dict[str, str]) -> None:
    """A test process's units, for the controller's scheduler (written before it reports its collection)."""
    path = Path(units_dir) / f"{worker}.json"
    path.with_suffix(".tmp").write_text(json.dumps(units))
    path.with_suffix(".tmp").replace(path)


def read_units(units_dir) -> dict[str, str]:
    """The units every test process wrote (they collect the same tests)."""
    units = {}
    for path in sorted(Path(units_dir).glob("*.json")):
        units.update(json.loads(path.read_text()))
    return units


def make_scheduler(config, log, units_dir):
    """xdist's scope scheduler with the units above as its scopes, handed out in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunScheduling(LoadScopeScheduling):
        units = None

        def _split_scope(self, nodeid):
            if self.units is None:
                self.units = read_units(units_dir)
            if nodeid not in self.units:
                raise RuntimeError(f"no test process wrote the unit of {nodeid} to {units_dir} "
                                   "(tests/conftest.py, pytest_collection_modifyitems)")
            return self.units[nodeid]

    config.option.loadscopereorder = False  # the collection order: schedule_order's
    return SharedRunScheduling(config, log)


def pin_share() -> None:
    """In a test process of `-n N`: its own share of the CPUs (every Nth of those this session may use),
    inherited by every server, workflow and training it starts. Without it each process's vLLM and
    torch spread their threads over all the cores, and two processes' threads wait on each other
    (what that cost the default workflow: benchmarks/RESULTS.md, "Test suite")."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker and 1 < count <= len(SESSION_CPUS):
        os.sched_setaffinity(0, SESSION_CPUS[int(worker.removeprefix("gw")) % count::count])
        if "torch" in sys.modules:  # imported before the share was taken: its threads would be one per core,
            # and two of them on one core wait on each other (the toy's greedy answers took over 20 minutes)
            sys.modules["torch"].set_num_threads(len(os.sched_getaffinity(0)))
