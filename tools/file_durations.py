"""Writes ``tests/file_durations.json`` (each test file's seconds, summed over its tests) from
the JUnit XML report of a full run of the suite, for tests/conftest.py, which starts the
longest files first so that pytest-xdist's processes end together.

Usage::

    python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --junitxml=report.xml
    python tools/file_durations.py report.xml

The numbers only order the files: stale ones make a run slower, never wrong.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "file_durations.json"


def file_durations(report: str) -> dict[str, float]:
    """``{"tests/x.py": seconds}`` summed over each file's test cases (setup, call and
    teardown, as pytest's report times them), longest first."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "")
        if not module:
            continue
        # classname: "tests.internal.test_x" or "tests.test_x.TestClass"
        parts = module.split(".")
        for end in range(len(parts), 0, -1):
            path = "/".join(parts[:end]) + ".py"
            if (ROOT / path).is_file():
                seconds[path] += float(case.get("time", 0))
                break
    return dict(sorted(((k, round(v, 1)) for k, v in seconds.items()),
                       key=lambda kv: (-kv[1], kv[0])))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    table = file_durations(argv[0])
    if not table:
        print(f"{argv[0]}: no test cases of files under {ROOT} found", file=sys.stderr)
        return 1
    OUT.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(table)} files, {sum(table.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
