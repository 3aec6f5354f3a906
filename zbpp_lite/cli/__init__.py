"""Command line: ``python -m zbpp_lite {plan,train,compare,adapt,launch} ...``. Layer 6, the top: may
import every layer below.

Each subcommand's module has ``add_parser(subparsers, help)`` and ``run(args) -> int`` and is imported only
when its command runs (``plan`` never imports JAX). Commands that run JAX switch on the persistent
compilation cache (:mod:`zbpp_lite.runtime.compile_cache`; ``ZBPP_LITE_COMPILE_CACHE=0`` turns it off).

A flag given on the command line is never silently ignored: where the chosen path does not use it, or
two inputs disagree, the command refuses in one line (:func:`given` tells a flag given from a default).
Every file a command writes is a flag added with :func:`add_output`; :func:`main` checks them all, making
missing folders, before the command computes anything (:func:`prepare_outputs`). Ctrl-C (SIGINT) and
SIGTERM end the command with one line, every process it started ended, exit status 128 + the signal.
"""

from __future__ import annotations

import _thread
import argparse
import importlib
import os
import signal
import sys
import threading

from ..runtime.compile_cache import use_compile_cache
from ..runtime.processes import RankFailed

COMMANDS = {
    "plan": "build, validate and simulate one schedule; print its grid (no JAX)",
    "train": "train the digits Transformer with one schedule on simulated or real devices",
    "compare": "run every schedule live and write an HTML report of planned vs measured timelines",
    "adapt": "measure a run, attribute its bubbles, rebalance and re-plan from measured costs, then train",
    "launch": "run the train command across N local processes on JAX's distributed runtime",
}


class CliError(Exception):
    """A bad argument or input: printed as one line, exit status 2."""


class Stopped(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM, raised in the main thread so every ``with`` block cleans up; printed as
    one line. ``signum``: the signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stopping: dict = {}  # "signum": the first stop signal of this run; "again": it was swallowed, raise anew


def _stop(signum, frame) -> None:
    if "signum" in _stopping and not _stopping.pop("again", False):
        return  # a second Ctrl-C must not interrupt the clean-up
    _stopping.setdefault("signum", signum)
    raise Stopped(_stopping["signum"])


def _unraisable(previous):
    """A ``sys.unraisablehook`` that raises :class:`Stopped` again in the main thread when it was raised
    where Python swallows exceptions (a gc callback, such as JAX's, or a ``__del__``); others to
    ``previous``."""

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, Stopped):
            return previous(unraisable)
        _stopping["again"] = True  # from another thread: raised here, it would be swallowed again
        threading.Timer(0.01, _thread.interrupt_main, (_stopping["signum"],)).start()

    return hook


def add_output(parser: argparse.ArgumentParser, flag: str, help: str, **options) -> None:
    """Add ``flag`` naming a file the command writes; :func:`prepare_outputs` checks it before any compute."""
    action = parser.add_argument(flag, metavar="PATH", help=help, **options)
    parser.set_defaults(_outputs=(*(parser.get_default("_outputs") or ()), (flag, action.dest)))


INPUT_PATHS = ("init", "schedule_csv", "from_csv")
"""The commands' input file flags (dests): an empty one is refused with the outputs', not read as absent."""


def prepare_outputs(args: argparse.Namespace) -> None:
    """Every output flag of ``args``' command that is given (:func:`add_output`): its folder made, and the
    file known writable, before anything is computed.

    Raises:
        CliError: naming the flag and the path: an empty path, a directory, a folder that cannot be made
            (a file where a folder should be), a file that cannot be written, or two flags naming one file.
    """
    outputs = [(flag, path) for flag, dest in getattr(args, "_outputs", ())
               if (path := getattr(args, dest)) is not None]
    inputs = [(f"--{d.replace('_', '-')}", getattr(args, d)) for d in INPUT_PATHS
              if getattr(args, d, None) is not None]
    for flag, path in inputs + outputs:
        if not path.strip():
            raise CliError(f"{flag} was given an empty path (an unset shell variable?); give a file's path, "
                           f"or leave {flag} out")
    seen: dict[str, str] = {}
    for flag, path in outputs:
        if (real := os.path.realpath(path)) in seen:
            raise CliError(f"{seen[real]} and {flag} both name {path!r}; give each its own file")
        seen[real] = flag
    for flag, path in outputs:
        check_output(flag, path)


def check_output(flag: str, path: str) -> None:
    """Make ``path``'s missing folders and check the file can be written (created and removed if new)."""
    if os.path.isdir(path):
        raise CliError(f"{flag} {path!r} is a directory; give a file's path, e.g. "
                       f"{os.path.join(path, 'out')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    above = folder
    while above and not os.path.exists(above):
        above = os.path.dirname(above)
    if above and not os.path.isdir(above):
        raise CliError(f"{flag} {path!r} cannot be written: {above!r} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        existed = os.path.exists(path)
        with open(path, "a"):
            pass
        if not existed:
            os.remove(path)
    except OSError as e:
        raise CliError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None


def _module(name: str):
    return importlib.import_module(f"zbpp_lite.cli.{name}")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zbpp_lite",
                                     description="Zero-bubble pipeline parallelism: plan, run, compare.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = None
    if argv:
        wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in COMMANDS.items():
        if wanted in COMMANDS and name != wanted:
            sub.add_parser(name, help=help_text)  # placeholder: do not import unrelated commands
            continue
        _module(name.replace("-", "_")).add_parser(sub, help_text)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed, plus ``given``: the dests the command line set itself, not by default (the same
    line parsed again with every default suppressed, so argparse leaves a flag not given unset)."""
    args = build_parser(argv).parse_args(argv)
    bare = build_parser(argv)
    commands = [a for a in bare._actions if isinstance(a, argparse._SubParsersAction)]
    for p in [bare, *(c for sub in commands for c in sub.choices.values())]:
        p._defaults.clear()  # argparse keeps no public list of a parser's options and defaults
        for action in p._actions:
            action.default = argparse.SUPPRESS
    args.given = frozenset(vars(bare.parse_args(argv))) - {"command"}
    return args


def given(args: argparse.Namespace, *dests: str) -> list[str]:
    """The flags among ``dests`` (argparse dests) given on the command line, as ``--flag``; none for
    ``args`` not made by :func:`parse_args`."""
    seen = getattr(args, "given", frozenset())
    return [f"--{d.replace('_', '-')}" for d in dests if d in seen]


def refuse_unused(args: argparse.Namespace, dests, why: str) -> None:
    """CliError ``{why}: drop --a, --b`` when any of ``dests`` was given (:func:`given`)."""
    if flags := given(args, *dests):
        raise CliError(f"{why}: drop {', '.join(flags)}")


def check_against_csv(args: argparse.Namespace, flag: str, schedule, unused: tuple[str, ...]) -> None:
    """A schedule read from a CSV (``flag``) is whole: any of ``unused`` given, or ``--ranks`` /
    ``--microbatches`` given and not the CSV's, is refused (CliError)."""
    refuse_unused(args, unused, f"{flag} reads the whole schedule")
    for dest, have in (("ranks", schedule.num_ranks), ("microbatches", schedule.num_microbatches)):
        if given(args, dest) and getattr(args, dest) != have:
            raise CliError(f"--{dest} {getattr(args, dest)} disagrees with {flag}'s {have} {dest}; give "
                           f"--{dest} {have} or drop it")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the stop signals are ours from the start: parsing imports the commands and JAX, a second or two
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _stop) for s in STOP_SIGNALS} if in_main else {}
    _stopping.clear()
    hook, sys.unraisablehook = sys.unraisablehook, _unraisable(sys.unraisablehook)
    command = next((a for a in argv if not a.startswith("-")), "zbpp_lite")  # until parsed
    try:
        args = parse_args(argv)
        command = args.command
        if args.command != "plan":  # plan never runs JAX
            use_compile_cache()  # every process of the run (and the next run) reuses compiled programs
        prepare_outputs(args)
        return int(_module(args.command.replace("-", "_")).run(args) or 0)
    except Stopped as e:
        how = "interrupted (Ctrl-C)" if e.signum == signal.SIGINT else "stopped by SIGTERM"
        print(f"{command}: {how}; every process it started has ended", file=sys.stderr)
        return 128 + e.signum
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad sizes, unknown schedule, invalid schedule: one line, no traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {first}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)  # a missing or unreadable input file: one line
        return 2
    except RankFailed as e:
        print(f"error: {e}", file=sys.stderr)  # a rank's process failed or died: which, and how
        return 1
    finally:
        sys.unraisablehook = hook
        for s, handler in previous.items():
            signal.signal(s, handler)
