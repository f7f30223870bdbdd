"""Run short distributed jobs many times in a row and count every run that did not end cleanly.

A job can do all its work, print all its output and still fail at exit: a process that
aborts while the interpreter shuts down ("terminate called without an active exception",
SIGABRT, a core dump) fails one run in a few, and only under some load. One run proves
nothing; this tool runs each kind of job N times, one after another, and counts per run
the exit status, the ``terminate called`` messages, the processes killed by SIGABRT, the
core dumps, and whether the job printed what it prints when it succeeds.

Kinds (4 ranks each):

``own-group``
    ``tools/soak_jobs/own_group_boxing.py`` through plain ``torchrun``: the script creates
    its own gloo group (``init_process_group("gloo")``) and never destroys it, boxes every
    1-D SBP pair between placements of 1-4 ranks (uneven and empty shapes), and ends.
``demo``
    The README demo, ``examples/data_parallel.py --epochs 1``, through
    ``python -m sbpflow.distributed.launch`` (sbpflow creates the group).
``pipeline``
    ``examples/pipeline.py`` (two stages on ranks 0 and 1; ranks 2 and 3 sit out) through
    plain ``torchrun``.
``two-hosts``
    ``tests/multihost/two_host_job.py`` on two simulated hosts (network namespaces, 2 ranks
    each, through the launcher); needs root and the ``ip`` and ``unshare`` commands.

Usage::

    python tools/soak.py --runs 50 own-group demo pipeline
    python tools/soak.py --runs 20 two-hosts
    python tools/soak.py --runs 20 --core-dumps own-group   # keep a core of each abort

It prints one line per run and a table per kind, keeps the output of every run that did
not end cleanly (``--log-dir``), and exits 0 only if every run ended cleanly. A core dump is
written only if the core size limit allows it (``--core-dumps`` lifts it for the jobs) and
only where ``/proc/sys/kernel/core_pattern`` puts cores in the crashing process's directory;
each run starts in a directory of its own, where the tool looks for them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_RANKS = 4
RUN_LIMIT_S = 600.0  # per run: a hang is reported, not waited for
_ABORTED_PID = re.compile(r"Signal 6 \(SIGABRT\) received by PID (\d+)")
_TERMINATE = "terminate called"


@dataclass(frozen=True)
class Run:
    """One job's outcome as seen from outside: exit statuses, output, time, the run's directory."""

    returncodes: tuple[int | None, ...]  # one per launcher started; None: killed at the limit
    output: str
    seconds: float
    directory: Path


@dataclass(frozen=True)
class Verdict:
    """What one run left behind that matters: clean only if everything is zero and all passed."""

    exit_ok: bool
    hung: bool
    terminate_messages: int
    aborted: int  # processes killed by SIGABRT
    core_dumps: int
    finished: bool  # the job printed everything it prints when it succeeded

    @property
    def clean(self) -> bool:
        return (
            self.exit_ok
            and not self.hung
            and self.terminate_messages == 0
            and self.aborted == 0
            and self.core_dumps == 0
            and self.finished
        )


def judge(run: Run, finished: Callable[[str], bool]) -> Verdict:
    aborted = len(set(_ABORTED_PID.findall(run.output)))
    if not aborted:  # a launcher's own status: -6 (killed by the signal) or 128 + 6 from a shell
        aborted = sum(rc in (-6, 134) for rc in run.returncodes)
    return Verdict(
        exit_ok=all(rc == 0 for rc in run.returncodes),
        hung=any(rc is None for rc in run.returncodes),
        terminate_messages=run.output.count(_TERMINATE),
        aborted=aborted,
        core_dumps=sum(1 for p in run.directory.iterdir() if p.name.startswith("core")),
        finished=finished(run.output),
    )


def _job_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a soak started from inside a launched job must not inherit it
    return env


def _allow_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


@dataclass(frozen=True)
class RunOptions:
    """How every job of a soak is started."""

    core_dumps: bool = False  # lift the core size limit for the job's processes
    wrapper: tuple[str, ...] = ()  # a command each job's command line runs under


def run_command(argv: list[str], directory: Path, options: RunOptions) -> Run:
    """Run one job (a launcher command line) in ``directory``; kill it at the limit.

    Under a wrapper (which may wait before it starts the job, e.g. for a lock), the limit
    is ``timeout``'s, inside the wrapper: it counts from the job's start, not the wait's.
    """
    limit = ["timeout", "--kill-after", "10", str(RUN_LIMIT_S)] if options.wrapper else []
    start = time.monotonic()
    proc = subprocess.Popen(
        [*options.wrapper, *limit, *argv],
        cwd=directory,
        env=_job_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the launcher and its workers: one process group to kill
        preexec_fn=_allow_core_dumps if options.core_dumps else None,
    )
    returncode: int | None
    try:
        output, _ = proc.communicate(timeout=None if options.wrapper else RUN_LIMIT_S)
        # 124: timeout's own status when the job ran past the limit
        returncode = None if options.wrapper and proc.returncode == 124 else proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        returncode = None
    with contextlib.suppress(ProcessLookupError):  # whatever a job killed at the limit left
        os.killpg(proc.pid, signal.SIGKILL)
    return Run((returncode,), output, time.monotonic() - start, directory)


@dataclass(frozen=True)
class Kind:
    """A kind of job: how to run it once, and how its output shows that it succeeded."""

    name: str
    run_once: Callable[[Path, RunOptions], Run]  # (the run's directory, how to start it)
    finished: Callable[[str], bool]
    session: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext


def _torchrun(script: str, *args: str) -> Callable[[Path, RunOptions], Run]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(NUM_RANKS), str(ROOT / script), *args]  # fmt: skip
    return lambda directory, options: run_command(argv, directory, options)


def _launcher(script: str, *args: str) -> Callable[[Path, RunOptions], Run]:
    argv = [sys.executable, "-m", "sbpflow.distributed.launch",
            "--nproc_per_node", str(NUM_RANKS), str(ROOT / script), *args]  # fmt: skip
    return lambda directory, options: run_command(argv, directory, options)


def _every_rank_says(pattern: str) -> Callable[[str], bool]:
    """Finished when each rank printed ``pattern`` (a regex whose group is the rank)."""
    regex = re.compile(pattern)
    return lambda output: set(regex.findall(output)) == {str(r) for r in range(NUM_RANKS)}


# examples/pipeline.py prints each of its 20 steps' loss as a number on rank 1 (the last
# stage, which holds it), one line per step; the other ranks print nothing.
_PIPELINE_LOSS = re.compile(r"^step \d+ loss \d+\.\d+$", re.MULTILINE)


class _TwoHosts:
    """The two simulated hosts, made once for a whole soak (tests/multihost/two_hosts.py)."""

    hosts: list[tuple[str, str, str]] | None = None

    @classmethod
    @contextlib.contextmanager
    def session(cls) -> Iterator[None]:
        from tests.multihost.two_hosts import two_hosts, why_unavailable

        reason = why_unavailable()
        if reason is not None:
            raise SystemExit(f"two-hosts: {reason}")
        with two_hosts() as hosts:
            cls.hosts = hosts
            try:
                yield
            finally:
                cls.hosts = None

    @classmethod
    def run_once(cls, directory: Path, options: RunOptions) -> Run:
        from tests.multihost.two_hosts import run_job

        assert cls.hosts is not None, "two-hosts runs inside its session"
        previous = resource.getrlimit(resource.RLIMIT_CORE)
        start = time.monotonic()
        if options.core_dumps:  # inherited by the launchers this process starts
            _allow_core_dumps()
        try:
            result = run_job(cls.hosts, cwd=directory, wrapper=options.wrapper)
        finally:
            resource.setrlimit(resource.RLIMIT_CORE, previous)
        return Run(result.returncodes, result.output, time.monotonic() - start, directory)


KINDS = {
    kind.name: kind
    for kind in [
        Kind(
            "own-group",
            _torchrun("tools/soak_jobs/own_group_boxing.py"),
            _every_rank_says(r"own-group job ok on rank (\d+)"),
        ),
        Kind(
            "demo",
            _launcher("examples/data_parallel.py", "--epochs", "1"),
            # rank 0 prints its results (print0) after the last collective every rank joined
            lambda output: "parameter checksum" in output,
        ),
        Kind(
            "pipeline",
            _torchrun("examples/pipeline.py"),
            lambda output: len(_PIPELINE_LOSS.findall(output)) == 20,
        ),
        Kind(
            "two-hosts",
            _TwoHosts.run_once,
            _every_rank_says(r"two-host job ok on rank (\d+)"),
            _TwoHosts.session,
        ),
    ]
}


def _describe(verdict: Verdict, run: Run) -> str:
    codes = ",".join("hung" if rc is None else str(rc) for rc in run.returncodes)
    if verdict.clean:
        return f"exit {codes}  {run.seconds:6.1f} s  clean"
    notes = [
        f"{verdict.terminate_messages}x '{_TERMINATE}'" if verdict.terminate_messages else "",
        f"{verdict.aborted} SIGABRT" if verdict.aborted else "",
        f"{verdict.core_dumps} core dump(s)" if verdict.core_dumps else "",
        "" if verdict.finished else "its output is incomplete",
    ]
    return f"exit {codes}  {run.seconds:6.1f} s  NOT CLEAN: " + ", ".join(n for n in notes if n)


def soak(kind: Kind, runs: int, log_dir: Path, options: RunOptions) -> list[tuple[Verdict, Run]]:
    results = []
    with kind.session():
        for index in range(1, runs + 1):
            directory = Path(tempfile.mkdtemp(prefix=f"soak-{kind.name}-{index}-", dir=log_dir))
            run = kind.run_once(directory, options)
            verdict = judge(run, kind.finished)
            print(f"{kind.name:9} {index:3}/{runs}  {_describe(verdict, run)}", flush=True)
            if verdict.clean:
                shutil.rmtree(directory, ignore_errors=True)
            else:
                (directory / "output.log").write_text(run.output)
            results.append((verdict, run))
    return results


def _table(all_results: dict[str, list[tuple[Verdict, Run]]]) -> str:
    header = (
        "| kind | runs | clean | exit 0 | 'terminate called' | SIGABRT | core dumps "
        "| median s |\n|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for name, results in all_results.items():
        verdicts = [v for v, _ in results]
        rows.append(
            f"| {name} | {len(results)} | {sum(v.clean for v in verdicts)} "
            f"| {sum(v.exit_ok for v in verdicts)} "
            f"| {sum(v.terminate_messages for v in verdicts)} "
            f"| {sum(v.aborted for v in verdicts)} | {sum(v.core_dumps for v in verdicts)} "
            f"| {statistics.median(r.seconds for _, r in results):.1f} |"
        )
    return "\n".join([header, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/soak.py",
        description="Run distributed jobs many times in a row and count unclean exits.",
    )
    parser.add_argument("kinds", nargs="+", choices=sorted(KINDS), help="kinds of job to run")
    parser.add_argument("--runs", type=int, default=20, help="runs of each kind (default 20)")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where each run's directory goes; failed runs keep theirs (default: a new temp dir)",
    )
    parser.add_argument(
        "--core-dumps",
        action="store_true",
        help="lift the core size limit for the jobs, so an abort leaves a core to debug",
    )
    parser.add_argument(
        "--wrapper",
        default="",
        help="a command to run each job under, e.g. one that shares the machine with other "
        "work; split on spaces",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    options = RunOptions(args.core_dumps, tuple(args.wrapper.split()))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="sbpflow-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    pattern = Path("/proc/sys/kernel/core_pattern")
    cores = pattern.read_text().strip() if pattern.exists() else "unknown"
    limit = (
        "lifted" if args.core_dumps else f"soft limit {resource.getrlimit(resource.RLIMIT_CORE)[0]}"
    )
    print(f"soak: {args.runs} run(s) of {', '.join(args.kinds)}; {NUM_RANKS} ranks each; "
          f"core_pattern {cores!r}, core size {limit}; logs in {log_dir}", flush=True)  # fmt: skip
    all_results = {name: soak(KINDS[name], args.runs, log_dir, options) for name in args.kinds}
    print(_table(all_results))
    clean = all(v.clean for results in all_results.values() for v, _ in results)
    if not clean:
        print(f"runs that did not end cleanly kept their output.log (and cores) under {log_dir}")
    elif args.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
