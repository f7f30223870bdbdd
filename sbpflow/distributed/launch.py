"""``python -m sbpflow.distributed.launch``: run a script on every rank.

Usage::

    python -m sbpflow.distributed.launch --nproc_per_node 4 train.py [train args]
    python -m sbpflow.distributed.launch --nnodes 2 --node_rank 0 \\
        --master_addr 10.0.0.1 --master_port 29500 --nproc_per_node 8 train.py

This is a thin front end over ``torch.distributed.run`` (torchrun, elastic): the options are
translated and torchrun's agent starts, watches and stops the workers. On one node the
rendezvous is standalone on a free port, so two launches on one machine never collide; on
several nodes it is the static rendezvous at ``--master_addr:--master_port``.

# NOTE [failing fast]
# When one rank raises, the others are usually blocked in a collective that would only
# time out minutes later. The agent polls its workers every ``monitor_interval`` seconds;
# on the first failure it sends SIGTERM to the rest and SIGKILL after ``shutdown_timeout``
# seconds. With the values below a failed run ends within a few seconds, the failing
# rank's traceback has already reached the console (workers inherit our stdout/stderr),
# and no worker outlives the launcher. The exit status is the failing rank's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "to_torchrun_argv"]

# Seconds between the agent's checks on its workers (torchrun's default is 0.1 in recent
# releases and was 5 in older ones; set it so the fail-fast bound does not depend on that).
_MONITOR_INTERVAL_S = 0.1
# Seconds a worker gets after SIGTERM before SIGKILL (torchrun's default is 30).
_SHUTDOWN_TIMEOUT_S = 5
# Static rendezvous port for multi-node runs that do not name one (torchrun's default).
_DEFAULT_MASTER_PORT = 29500


def _int_at_least(name: str, minimum: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be an integer >= {minimum}, got {value!r}"
            ) from None
        if number < minimum:
            raise argparse.ArgumentTypeError(
                f"{name} must be an integer >= {minimum}, got {number}"
            )
        return number

    return parse


def _port(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(
            f"--master_port must be a TCP port in 1..65535, got {value!r}"
        )
    return number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sbpflow.distributed.launch",
        description="Run a Python script on every rank (one process per rank).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        type=_int_at_least("--nproc_per_node", 1),
        default=1,
        help="processes (ranks) to start on this node (default 1)",
    )
    parser.add_argument(
        "--nnodes",
        type=_int_at_least("--nnodes", 1),
        default=1,
        help="number of nodes (default 1)",
    )
    parser.add_argument(
        "--node_rank",
        "--node-rank",
        type=_int_at_least("--node_rank", 0),
        default=0,
        help="this node's index in 0..nnodes-1 (default 0)",
    )
    parser.add_argument(
        "--master_addr",
        "--master-addr",
        default="127.0.0.1",
        help="address of node 0 (multi-node only; default 127.0.0.1)",
    )
    parser.add_argument(
        "--master_port",
        "--master-port",
        type=_port,
        default=None,
        help="port on node 0; on one node a free port is picked when omitted; "
        f"multi-node default {_DEFAULT_MASTER_PORT}",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the script argument as a module, like `python -m`",
    )
    parser.add_argument("script", help="the Python script (or module with -m) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def to_torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The ``torch.distributed.run`` command line equivalent to our parsed ``args``."""
    argv = [
        f"--nproc_per_node={args.nproc_per_node}",
        f"--monitor_interval={_MONITOR_INTERVAL_S}",
        f"--shutdown_timeout={_SHUTDOWN_TIMEOUT_S}",
    ]
    if args.nnodes == 1 and args.master_port is None:
        argv.append("--standalone")
    else:
        port = _DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
        argv += [
            f"--nnodes={args.nnodes}",
            f"--node_rank={args.node_rank}",
            f"--master_addr={args.master_addr}",
            f"--master_port={port}",
        ]
    if args.module:
        argv.append("--module")
    return [*argv, args.script, *args.script_args]


def _drop_unknown_options(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` without ``--name=value`` options this torch's torchrun does not have.

    ``--shutdown_timeout`` is recent; on an older torch the agent's default applies.
    """
    known = parser._option_string_actions
    kept: list[str] = []
    for position, arg in enumerate(argv):
        if not arg.startswith("--"):
            return kept + argv[position:]  # the script and its own arguments
        if arg.split("=", 1)[0] in known:
            kept.append(arg)
    return kept


def _check(args: argparse.Namespace) -> str | None:
    """An error message for arguments argparse cannot check alone, or None."""
    if args.node_rank >= args.nnodes:
        return (
            f"--node_rank must be in 0..{args.nnodes - 1} for --nnodes {args.nnodes}, "
            f"got {args.node_rank}"
        )
    if not args.module and not os.path.isfile(args.script):
        return (
            f"script {args.script!r} not found (cwd {os.getcwd()!r}); pass the path of a "
            "Python file, or -m NAME for a module"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the workers, return the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:  # argparse already printed usage and the error
        return exit_.code if isinstance(exit_.code, int) else 2
    problem = _check(args)
    if problem is not None:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2

    # One thread per rank unless the user set OMP_NUM_THREADS, for one process as for many.
    # torchrun does it for several processes only (N ranks of one thread per core each would
    # oversubscribe the cores); doing it for one too keeps `--nproc_per_node 1` the same
    # script's single-rank run with the same threads per rank, instead of a run whose
    # threads fight other processes for the cores on a busy machine (several times slower).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    # Imported here so that `--help` and argument errors stay fast.
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    torchrun_argv = _drop_unknown_options(to_torchrun_argv(args), torchrun.get_args_parser())
    try:
        torchrun.run(torchrun.parse_args(torchrun_argv))
    except ChildFailedError as error:
        sys.stdout.flush()
        print(error.format_msg(), file=sys.stderr)
        _, failure = error.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal
            return 128 - failure.exitcode
        return failure.exitcode if 0 < failure.exitcode < 256 else 1
    except SignalException as error:
        print(f"{parser.prog}: stopped by signal {error.sigval.name}", file=sys.stderr)
        return 128 + int(error.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
