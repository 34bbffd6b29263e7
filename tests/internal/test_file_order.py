"""The suite runs its longest files first (tests/conftest.py), with the seconds that
tools/file_durations.py writes from a run's JUnit XML report."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("file_durations",
                                                  ROOT / "tools" / "file_durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_file_durations_sums_each_files_cases_from_a_junit_report(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_chaos" name="a" time="60.5"/>'
        '<testcase classname="tests.test_chaos" name="b" time="30.25"/>'
        '<testcase classname="tests.internal.test_rerun.TestRerun" name="c" time="2"/>'
        '<testcase classname="tests.not_a_file" name="d" time="9"/>'
        "</testsuite></testsuites>")
    table = _tool().file_durations(str(report))
    assert table == {"tests/test_chaos.py": 90.8, "tests/internal/test_rerun.py": 2.0}
    assert list(table) == ["tests/test_chaos.py", "tests/internal/test_rerun.py"]


def test_the_table_names_files_that_exist():
    table = json.loads((ROOT / "tests" / "file_durations.json").read_text())
    missing = [f for f in table if not (ROOT / f).is_file()]
    assert table and not missing, f"tests/file_durations.json names missing files: {missing}"


def test_this_run_orders_its_files_longest_first(request):
    seconds = json.loads((ROOT / "tests" / "file_durations.json").read_text())
    files: dict[str, int] = {}
    for item in request.session.items:
        name = pathlib.Path(os.path.relpath(item.path, ROOT)).as_posix()
        files[name] = files.get(name, 0) + 1
    weights = [seconds.get(f, 0.2 * n) for f, n in files.items()]
    assert weights == sorted(weights, reverse=True), list(zip(files, weights))[:10]
