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
    runners: dict[str, Callable[[int], None]], steps: int, repeats: int,
    rounds: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Median seconds per step of each runner, measured in interleaved, rotated rounds.

    Each runner is called as ``runner(steps)`` and must block until its steps are done.
    Interleaving (A, B, A, B, ...) spreads machine noise evenly over the candidates, and each
    round starts one runner later than the previous (A, B, C; B, C, A; ...) so no runner always
    runs right after the same other one. ``rounds``, when given, receives every round's
    seconds per step (for ``paired_ratio``).
    """
    samples: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            run = runners[name]
            start = time.perf_counter()
            run(steps)
            samples[name].append((time.perf_counter() - start) / steps)
    if rounds is not None:
        rounds.update(samples)
    return {name: statistics.median(v) for name, v in samples.items()}


def paired_ratio(rounds: dict[str, list[float]], candidate: str, baselines: Sequence[str]) -> float:
    """Median over rounds of (best baseline's seconds / candidate's seconds) in the same round.

    Each round times every runner back to back, so a ratio within a round cancels most of a
    load drift that the ratio of two medians taken over different rounds keeps.
    """
    return statistics.median(
        min(rounds[b][r] for b in baselines) / rounds[candidate][r]
        for r in range(len(rounds[candidate]))
    )


def machine_line() -> str:
    """One line naming the machine a benchmark ran on (CPUs, load, devices, versions)."""
    import platform

    import jax

    try:
        load = "load average {:.1f}/{:.1f}/{:.1f}".format(*os.getloadavg())
    except OSError:
        load = "load average unknown"
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    return (f"Machine: {os.cpu_count()} CPU(s) ({platform.machine()}, {platform.system()}), "
            f"{load}; {jax.device_count()} {dev.platform} device(s) "
            f"({kind}); jax {jax.__version__}, Python {platform.python_version()}")


def print_machine() -> str:
    """Prints (and returns) ``machine_line()``."""
    line = machine_line()
    print(line + "\n", flush=True)
    return line


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
