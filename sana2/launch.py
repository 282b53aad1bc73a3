"""The sana2 launcher: torchrun's command line and elastic agent, made to answer a scheduler.

    python -m sana2.launch [torchrun options] -m sana2.train CONFIG [--section.key=value ...]
    python -m sana2.launch [torchrun options] -m sana2.prepare INPUT ... --output DIR ...

run_train.sh execs it in place of torchrun. It takes torchrun's options through torchrun's own
parser (--nnodes, --nproc_per_node, --rdzv_backend, --rdzv_endpoint, --rdzv_id, --rdzv_conf,
--standalone, --max_restarts, --local_ranks_filter, --tee, ... and their PET_* variables) and starts
the workers with the public `torch.distributed.launcher.api.elastic_launch`, as torchrun does. It
differs where torchrun fails a batch job:

- Before any worker starts, it checks the training config (sana2.preflight.check_run: every key, the
  world size, the encoders it names, the checkpoint to resume from), or sana2.prepare's arguments: a bad
  one is one message and exit code 2.
- SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C) are forwarded to the workers, which stop
  at their next safe point and save a checkpoint (sana2/components/preemption.py); the launcher
  waits for them up to job.stop_grace_period and exits 0 once they all have; sana2.prepare's workers stop
  at once, keeping the shards they finished (a rerun resumes). (torchrun raises a
  SignalException, kills workers still running after 30 s and exits 1 with a traceback.) If the grace
  period ends first, it says so and kills them; a second Ctrl-C kills them at once.
- A worker that exits with code 2 (an error the user must fix) ends the launcher with exit code 2
  and that worker's message, shown once (workers whose output is shown have printed it already),
  instead of torchrun's ChildFailedError traceback and exit 1. Any other failure keeps torchrun's
  report, traceback and exit code 1.

torchrun's own log lines are left out unless LOGLEVEL is set. Multi-node: run it on every node with
the same rendezvous options; a signal to any node's launcher stops the whole job at the same step
(the workers agree on it), and each node's launcher then exits 0.
"""

import logging
import os
import signal
import sys
import threading
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, determine_local_world_size, get_args_parser, parse_min_max_nnodes

from sana2.cli import USER_ERROR
from sana2.config import ConfigError, Job, main_config
from sana2.formats.pipeline import pipeline_defaults
from sana2.preflight import check_resume_from, check_run

FORWARDED = (signal.SIGTERM, signal.SIGINT)
PREPARE = "sana2.prepare"  # the entry point that is not training: its own arguments, its own stop


def say(message: str) -> None:
    print(f"[sana2.launch] {message}", file=sys.stderr, flush=True)


def worker_pids() -> list[int]:
    """This process's workers: its children that lead their own session (torchelastic starts each
    worker in a new session), found in /proc."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        parent, session = int(fields[1]), int(fields[3])
        if parent == me and session == int(entry.name):
            found.append(int(entry.name))
    return found


class NoWorkers(Exception):
    """A stop signal came while no worker ran (during the rendezvous): nothing to save."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopper:
    """Forwards SIGTERM and SIGINT to the workers, then kills them when the grace period ends."""

    def __init__(self, grace_period: float, on_stop: str):
        """`on_stop`: what the workers do when told to stop, for the console."""
        self.grace_period = grace_period
        self.on_stop = on_stop
        self.signum = 0  # the first stop signal, 0 if none
        self.killed = False
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        for signum in FORWARDED:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        workers = worker_pids()
        if not workers:
            raise NoWorkers(signum)
        name = signal.Signals(signum).name
        if self.signum:
            if signum == signal.SIGINT:
                say("second interrupt: killing the workers now")
                self._kill(workers)
            return
        self.signum = signum
        say(f"{name}: {self.on_stop} (grace period {self.grace_period:g} s)")
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        self._timer = threading.Timer(self.grace_period, self._grace_period_over)
        self._timer.daemon = True
        self._timer.start()

    def _grace_period_over(self) -> None:
        workers = worker_pids()
        if workers:
            say(
                f"the {self.grace_period:g} s grace period is over and {len(workers)} worker(s) still run: "
                f"killing them (the latest complete checkpoint stays intact)"
            )
            self._kill(workers)

    def _kill(self, workers: list[int]) -> None:
        self.killed = True
        for pid in workers:
            try:
                os.killpg(pid, signal.SIGKILL)  # a worker leads its process group: its own children go too
            except ProcessLookupError:
                pass


def quiet_torchelastic() -> None:
    """Leave out torchrun's log lines (agent start, closing signals, a worker's exit code): the
    launcher reports outcomes itself. LOGLEVEL (torchelastic's own setting) brings them back."""
    if "LOGLEVEL" not in os.environ:
        for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _message(failure) -> str:
    message = failure.message  # from the worker's error file: a dict in ErrorHandler's layout, or text
    return str(message.get("message", "") if isinstance(message, dict) else message)


def _shown_ranks(args) -> set[int] | None:
    """The local ranks whose stderr reaches this console (None: all)."""
    redirects, tee = Std.from_str(args.redirects), Std.from_str(args.tee)
    if isinstance(redirects, dict) or isinstance(tee, dict):
        return set()  # per-rank settings: do not guess, show every message
    if redirects in (Std.ERR, Std.ALL) and tee not in (Std.ERR, Std.ALL):
        return set()
    if args.local_ranks_filter:
        return {int(rank) for rank in args.local_ranks_filter.split(",")}
    return None


def user_error(failed: ChildFailedError, shown: set[int] | None) -> list[str] | None:
    """If the first failure is a worker's exit with code 2, the distinct messages of such workers
    that the console has not shown yet (rank-prefixed); None for any other failure."""
    failures = failed.failures.values()
    first = min(failure.timestamp for failure in failures)  # whole seconds: ties are likely
    if not any(f.exitcode == USER_ERROR and f.timestamp == first for f in failures):
        return None
    messages = {rank: _message(f) for rank, f in sorted(failed.failures.items()) if f.exitcode == USER_ERROR}
    seen = {
        messages[rank]
        for rank, f in failed.failures.items()
        if rank in messages and (shown is None or f.local_rank in shown)
    }
    hidden: dict[str, int] = {}
    for rank, message in messages.items():
        # a rank that stopped because of another's error shows it as "rank R: <message>"
        if message and message not in seen and f"rank {rank}: {message}" not in seen:
            hidden.setdefault(message, rank)
    return [f"rank {rank}: {message}" for message, rank in hidden.items()]


USAGE = """python -m sana2.launch [torchrun options] -m sana2.train CONFIG [--section.key=value ...]
       python -m sana2.launch [torchrun options] -m sana2.prepare INPUT ... --output DIR ...

sana2's launcher: torchrun's options and elastic agent, plus a check of the training config (or prepare's
arguments) before any worker starts (exit 2 with one message), SIGTERM/SIGINT forwarded as a stop at the next
safe point with a checkpoint (prepare: at once, keeping its finished shards; exit 0), and a worker's user error
reported once with exit 2 (sana2/launch.py). The training config's keys: python -m sana2.train --help;
prepare's arguments: python -m sana2.prepare --help. torchrun's options follow."""


def build_parser():
    """torchrun's own parser, led by sana2's usage."""
    parser = get_args_parser()
    parser.prog = "python -m sana2.launch"
    parser.usage = USAGE
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_torchelastic()
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.module and args.training_script == PREPARE:
        from sana2.prepare import parse_args as check_prepare_arguments

        check_prepare_arguments(args.training_script_args)  # a bad one: argparse's message and exit 2
        stopper = Stopper(Job().stop_grace_period, "the workers stop now and keep the shards they finished")
    else:
        try:
            config = main_config(args.training_script_args, pipeline_defaults)
            if min_nodes == max_nodes:  # an elastic job's world size is known only once the nodes meet
                check_run(config, determine_local_world_size(args.nproc_per_node) * max_nodes)
            else:
                check_resume_from(config)
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return USER_ERROR
        stopper = Stopper(
            config.job.stop_grace_period,
            "the workers stop at their next safe point and save a checkpoint (job.stop_grace_period)",
        )
    # as torchrun's run(): a one-node job without a rendezvous endpoint gets a local one
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None):
        if args.standalone or max_nodes == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    launch_config, entrypoint, entrypoint_args = config_from_args(args)
    # the agent must not turn SIGTERM/SIGINT into a SignalException: this launcher handles them
    others = [name for name in args.signals_to_handle.split(",") if name.strip() not in ("SIGTERM", "SIGINT")]
    launch_config.signals_to_handle = ",".join(others) or "SIGHUP"
    stopper.install()
    try:
        elastic_launch(launch_config, entrypoint)(*entrypoint_args)
    except NoWorkers as exc:
        say(f"{exc} while no worker ran: nothing to save")
        return 128 + exc.signum
    except ChildFailedError as failed:
        if stopper.killed:
            return 128 + stopper.signum
        messages = user_error(failed, _shown_ranks(args))
        if messages is None:
            raise
        for message in messages:
            print(message, file=sys.stderr)
        return USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
