"""Shared helpers for benchmarks: forced CPU devices, timing, and table printing."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence


def force_cpu_devices(n: int = 8) -> None:
    """Forces ``n`` CPU host devices when no accelerator is present (call before importing jax)."""
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(n))
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def time_interleaved(
    runners: dict[str, Callable[[int], None]], steps: int, repeats: int
) -> dict[str, float]:
    """Median seconds per step of each runner, measured in interleaved rounds.

    Each runner is called as ``runner(steps)`` and must block until its steps are done.
    Interleaving (A, B, A, B, ...) spreads machine noise evenly over the candidates.
    """
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run(steps)
            samples[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(v) for name, v in samples.items()}


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Prints (and returns) a Markdown table."""
    lines = [
        f"### {title}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(c) for c in row) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:,.3f}" if abs(c) < 100 else f"{c:,.0f}"
    return str(c)
