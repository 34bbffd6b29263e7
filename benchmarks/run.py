"""Runs every benchmark and prints their tables: ``python -m benchmarks.run [--quick]``.

Each benchmark runs in its own process (they set their own device counts and start their own
clusters). ``--only NAME`` runs one; ``--out FILE`` also writes the tables to a Markdown file.
"""

from __future__ import annotations

import argparse
import pkgutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

QUICK_ARGS = {
    "bench_strategy_step": ["--steps", "2", "--repeats", "2", "--devices", "1", "8"],
    "bench_multi_worker": ["--steps", "2", "--repeats", "2"],
    "bench_steps_per_execution": ["--steps", "64", "--repeats", "1", "--ks", "1", "4", "64"],
}


def discover() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if m.name.startswith("bench_"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", action="append", help="run only this benchmark (repeatable)")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--out", type=Path, help="also write the tables to this Markdown file")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per benchmark")
    args = parser.parse_args(argv)
    names = args.only or discover()
    unknown = sorted(set(names) - set(discover()))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {discover()}")
    outputs, failed = [], []
    for name in names:
        cmd = [sys.executable, "-m", f"benchmarks.{name}"]
        if args.quick:
            cmd += QUICK_ARGS.get(name, ["--quick"])
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=HERE.parent, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            print(f"!! {name} timed out after {args.timeout:.0f} s", flush=True)
            failed.append(name)
            continue
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            print(f"!! {name} failed with exit code {proc.returncode}", flush=True)
            failed.append(name)
        else:
            outputs.append(proc.stdout)
        print(f"== {name}: {time.monotonic() - start:.0f} s\n", flush=True)
    if args.out:
        args.out.write_text("\n\n".join(outputs))
    if failed:
        print(f"failed: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
