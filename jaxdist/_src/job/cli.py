"""``python -m jaxdist.train --config configs/default.yaml [--set section.key=value ...]``.

Exit status: 0 when training finishes, 2 for a bad config (or command line, labels of the wrong
kind for the loss, a data file that is not .npz, a checkpoint written for another model or with
other settings, a checkpoint directory that cannot be written, a one-process strategy started as
several tasks), 3 when the checkpoint already completes the configured training (nothing to
train), 1 when training fails (bad data, NaN loss with ``halt_on_nan``, a device error), 130
when interrupted (``jaxdist._src.distributed.exit_codes``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130
_PROG = "python -m jaxdist.train"


class _Parser(argparse.ArgumentParser):
    """Writes its epilog, the table of every config key, only when ``--help`` prints it (the
    table names every registered strategy's keys, which imports their modules)."""

    def format_help(self) -> str:
        from jaxdist._src.job.config import schema_help

        self.epilog = (
            "config keys (section.key, type, default):\n" + schema_help() + "\n\n"
            "exit status: 0 done, 1 training failed, 2 bad config, 3 nothing to train "
            "(the checkpoint completes the config), 130 interrupted.\n"
            "docs: docs/trainer.md")
        return super().format_help()


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=_PROG,
        description="Train a model with a jaxdist strategy, as a YAML config describes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", "-c", required=True, metavar="FILE",
                   help="YAML config, e.g. configs/default.yaml")
    p.add_argument("--set", "-s", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   dest="overrides",
                   help="override a config value (YAML syntax), e.g. --set train.epochs=5; "
                        "repeatable")
    p.add_argument("--run-name", metavar="NAME", default=None,
                   help="name this run's directory <logging.dir>/NAME (default: the start "
                        "time); it must not hold an earlier run")
    p.add_argument("--print-config", action="store_true",
                   help="print the validated config (defaults filled in) and exit")
    p.add_argument("--compile-only", action="store_true",
                   help="compile one training dispatch for the strategy's devices without "
                        "running it, print its per-device memory and FLOPs, and exit")
    p.add_argument("--topology", metavar="NAME", default=None,
                   help="with --compile-only and strategy 'tpu': compile for this TPU "
                        "topology (e.g. v5e:2x2, v4:2x2x1, v5p:2x2x1) without a TPU "
                        "(needs libtpu: pip install 'jaxdist[tpu]'); sets strategy.topology")
    return p


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status."""
    from jaxdist._src.job.config import ConfigError, dump, load_config

    args = _parser().parse_args(argv)
    err = sys.stderr
    notes: list[str] = []
    overrides = list(args.overrides)
    if args.run_name is not None:
        overrides.append(f"logging.run_name={args.run_name}")
    if args.topology is not None:
        overrides.append(f"strategy.topology={args.topology}")
    try:
        cfg = load_config(args.config, overrides, notes=notes)
    except ConfigError as e:
        print(f"{_PROG}: config error: {_one_line(e)}", file=err)
        return EXIT_CONFIG
    for note in notes:
        print(f"{_PROG}: note: {note}", file=err)
    if args.print_config:
        print(dump(cfg), end="")
        return EXIT_OK
    if cfg["strategy"].get("topology") and not args.compile_only:
        print(f"{_PROG}: config error: strategy.topology={cfg['strategy']['topology']!r} "
              f"compiles for a TPU without one and cannot train: add --compile-only",
              file=err)
        return EXIT_CONFIG
    if args.compile_only:
        return _compile_only(cfg)

    from jaxdist._src.job.strategy_registry import config_for

    spec = config_for(cfg["strategy"]["name"])
    try:
        if spec.serves is not None and spec.serves(cfg):  # e.g. a ps task: serve until stopped
            return spec.serve(cfg)
    except ConfigError as e:
        print(f"{_PROG}: config error: {_one_line(e)}", file=err)
        return EXIT_CONFIG

    from jaxdist._src.cluster.tpu_cluster_resolver import TPUNotFoundError
    from jaxdist._src.distributed.termination import TerminationConfigError
    from jaxdist._src.job.job import run_job
    from jaxdist._src.train.checkpoint import CheckpointDirError, CheckpointMismatchError
    from jaxdist._src.train.data import DataError
    from jaxdist._src.train.run_record import TrainingCompleteError
    from jaxdist._src.train.runs import RunDirError
    from jaxdist._src.train.trainer import NaNLossError

    try:
        run_job(cfg)
    except ConfigError as e:
        print(f"{_PROG}: config error: {_one_line(e)}", file=err)
        return EXIT_CONFIG
    except (RunDirError, CheckpointDirError) as e:
        print(f"{_PROG}: config error: {_one_line(e)}", file=err)
        return EXIT_CONFIG
    except NaNLossError as e:
        print(f"{_PROG}: training stopped: {_one_line(e)}", file=err)
        return EXIT_FAILED
    except DataError as e:
        print(f"{_PROG}: data error: {_one_line(e)}", file=err)
        return getattr(e, "exit_code", EXIT_FAILED)
    except TrainingCompleteError as e:
        print(f"{_PROG}: {_one_line(e)}", file=err)
        return e.exit_code
    except CheckpointMismatchError as e:  # another model, or other settings
        print(f"{_PROG}: checkpoint error: {_one_line(e)}", file=err)
        return e.exit_code
    except TerminationConfigError as e:
        print(f"{_PROG}: config error: {_one_line(e)}", file=err)
        return EXIT_CONFIG
    except TPUNotFoundError as e:
        print(f"{_PROG}: no TPU: {_one_line(e)} (use configs/mirrored.yaml, or set "
              f"strategy.devices)", file=err)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=err)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - one line, then a non-zero exit
        print(f"{_PROG}: training failed: {type(e).__name__}: {_one_line(e)}", file=err)
        return EXIT_FAILED
    return EXIT_OK


def _compile_only(cfg: dict) -> int:
    """``--compile-only``: compiles the job's training step and prints the report."""
    from jaxdist._src.cluster.tpu_cluster_resolver import TPUNotFoundError
    from jaxdist._src.job.config import ConfigError
    from jaxdist._src.job.job import compile_job
    from jaxdist._src.train.data import DataError

    err = sys.stderr
    try:
        report = compile_job(cfg)
    except (ConfigError, ValueError) as e:
        print(f"{_PROG}: config error: {_one_line(e)}", file=err)
        return EXIT_CONFIG
    except ImportError as e:
        print(f"{_PROG}: {_one_line(e)}", file=err)
        return EXIT_FAILED
    except DataError as e:
        print(f"{_PROG}: data error: {_one_line(e)}", file=err)
        return getattr(e, "exit_code", EXIT_FAILED)
    except TPUNotFoundError as e:
        print(f"{_PROG}: no TPU: {_one_line(e)} (use --topology to compile for one)", file=err)
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - one line, then a non-zero exit
        print(f"{_PROG}: compilation failed: {type(e).__name__}: {_one_line(e)}", file=err)
        return EXIT_FAILED
    print(report)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
