"""Command line: ``python -m zbpp_lite {plan,train,compare,adapt,launch} ...``. Layer 6, the top: may
import every layer below.

Each subcommand's module has ``add_parser(subparsers, help)`` and ``run(args) -> int`` and is imported only
when its command runs (``plan`` never imports JAX). Commands that run JAX switch on the persistent
compilation cache (:mod:`zbpp_lite.runtime.compile_cache`; ``ZBPP_LITE_COMPILE_CACHE=0`` turns it off).
"""

from __future__ import annotations

import argparse
import importlib
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


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so every ``with`` block cleans up; printed as one line."""


def _terminated(signum, frame) -> None:
    raise Terminated()


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command != "plan":  # plan never runs JAX
        use_compile_cache()  # every process of the run (and the next run) reuses compiled programs
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main else None
    try:
        return int(_module(args.command.replace("-", "_")).run(args) or 0)
    except Terminated:
        print(f"{args.command}: stopped by SIGTERM; every process it started has ended", file=sys.stderr)
        return 128 + signal.SIGTERM
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
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
