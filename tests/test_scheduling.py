"""How xdist's processes split the suite (tests/support/scheduling.py): a test that requests a shared run,
directly or through another fixture, brings its module into that run's unit; every other module is a unit
of its own; each unit runs in one process, so a shared run starts once."""
import os
import subprocess
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest

from tests.support.config import ROOT
from tests.support.scheduling import schedule_order, schedule_units

pytestmark = pytest.mark.timeout(300)

SHARED = ["long_run", "short_run", "cluster_run"]


def item(nodeid, *fixtures, vllm=False):
    return SimpleNamespace(nodeid=nodeid, fixturenames=["request", *fixtures],
                           get_closest_marker=lambda name: object() if vllm and name == "vllm" else None)


def test_a_module_joins_the_run_one_of_its_tests_requests_and_other_modules_stay_units_of_their_own():
    items = [item("tests/test_a.py::test_plain"), item("tests/test_a.py::test_uses", "tmp_path", "long_run"),
             item("tests/test_new.py::test_uses", "long_run"), item("tests/test_b.py::test_one"),
             item("tests/test_b.py::test_two", "tmp_path"), item("tests/test_c.py::test_indirect", "through", "short_run")]
    assert schedule_units(items, SHARED) == {
        "tests/test_a.py::test_plain": "long_run", "tests/test_a.py::test_uses": "long_run",
        "tests/test_new.py::test_uses": "long_run", "tests/test_b.py::test_one": "tests/test_b.py",
        "tests/test_b.py::test_two": "tests/test_b.py", "tests/test_c.py::test_indirect": "short_run"}


def test_a_module_that_requests_two_runs_makes_them_one_unit_named_for_the_first_declared():
    items = [item("tests/test_x.py::test_cluster", "cluster_run"), item("tests/test_y.py::test_short", "short_run"),
             item("tests/test_both.py::test_short", "short_run"), item("tests/test_both.py::test_cluster", "cluster_run"),
             item("tests/test_z.py::test_long", "long_run")]
    units = schedule_units(items, SHARED)
    assert {units[i.nodeid] for i in items[:4]} == {"short_run"}
    assert units["tests/test_z.py::test_long"] == "long_run"


def test_the_shared_runs_come_first_in_declared_order_then_the_units_that_start_vllm_then_the_rest():
    items = [item("tests/test_plain.py::test_1"), item("tests/test_server.py::test_1", vllm=True),
             item("tests/test_short.py::test_1", "short_run"), item("tests/test_plain.py::test_2"),
             item("tests/test_server.py::test_2"), item("tests/test_long.py::test_1", "long_run"),
             item("tests/test_short.py::test_2")]
    schedule_order(items, schedule_units(items, SHARED), SHARED)
    assert [i.nodeid for i in items] == [
        "tests/test_long.py::test_1", "tests/test_short.py::test_1", "tests/test_short.py::test_2",
        "tests/test_server.py::test_1", "tests/test_server.py::test_2", "tests/test_plain.py::test_1",
        "tests/test_plain.py::test_2"]


# A suite of its own, with the suite's hooks (tests/conftest.py) and two shared runs, run in two xdist
# processes: every test notes its process, every shared run notes its start.
CONFTEST = '''
import os
from pathlib import Path

import pytest

from tests.conftest import (pytest_collection_modifyitems, pytest_configure_node,  # noqa: F401
                            pytest_unconfigure, pytest_xdist_make_scheduler)
from tests.support.scheduling import shared_run


def note(what):
    with open(Path(__file__).parent / "notes.txt", "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {what}\\n")


@pytest.fixture(scope="session")
@shared_run
def long_run():
    note("start long_run")


@pytest.fixture(scope="session")
@shared_run
def short_run():
    note("start short_run")


@pytest.fixture
def through(short_run):
    pass


@pytest.fixture(autouse=True)
def where(request):
    note(request.node.nodeid)
'''

MODULES = {
    "test_long.py": "def test_uses(long_run): pass\ndef test_plain(): pass\n",
    "test_new.py": "def test_joins_without_a_list(long_run): pass\n",
    "test_short.py": "def test_indirect(through): pass\ndef test_plain(): pass\n",
    "test_also_short.py": "def test_direct(short_run): pass\n",
    **{f"test_plain_{i}.py": "def test_1(): pass\ndef test_2(): pass\n" for i in range(4)},
}


def test_in_two_processes_each_shared_run_starts_once_and_each_unit_runs_in_one_process(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "."],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    notes = [line.split(" ", 1) for line in (tmp_path / "notes.txt").read_text().splitlines()]
    starts = [what for _, what in notes if what.startswith("start ")]
    assert sorted(starts) == ["start long_run", "start short_run"]
    workers = defaultdict(set)
    for worker, what in notes:
        unit = {"start long_run": "long", "start short_run": "short"}.get(what)
        module = what.split("::", 1)[0]
        unit = unit or {"test_long.py": "long", "test_new.py": "long", "test_short.py": "short",
                        "test_also_short.py": "short"}.get(module, module)
        workers[unit].add(worker)
    assert len(workers) == 2 + 4 and all(len(w) == 1 for w in workers.values()), dict(workers)
    assert len(set().union(*workers.values())) == 2, f"both processes ran tests: {dict(workers)}"
