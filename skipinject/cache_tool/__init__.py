"""``skipinject cache ...``: see, verify, show, compare, import, prune and compact what is cached.

Exit status: 0 fine, 1 something was found, 2 bad usage or path, 3 an internal error (docs/cache-tool.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from skipinject.errors import SkipInjectError, did_you_mean

DESCRIPTION = "See, verify, show, compare, import, prune and remove skipinject's (and verl's own) rollout caches."


def local_path(text: str) -> Path:
    """A command-line path; ``file://`` URLs are local paths, other URLs are refused in one line."""
    from skipinject.dump_root import is_remote, local_path_text

    if is_remote(text):
        raise argparse.ArgumentTypeError(
            f"{text}: a remote store's URL; only `skipinject cache ls`, `verify`, `prune` and `rm` take those"
        )
    if not local_path_text(text):  # Path("") is the working directory: an unset "$DUMP" must not prune it
        raise argparse.ArgumentTypeError(
            f"{text!r}: an empty path (give a dump directory, or leave it out for the default)"
        )
    return Path(local_path_text(text))


def location(text: str) -> Path | str:
    """A local path, or a remote store's URL (``ls``, ``verify``, ``prune`` and ``rm`` take both)."""
    from skipinject.dump_root import is_remote

    return text.rstrip("/") if is_remote(text) else local_path(text)


#: A command's parser: ``command(name, run, help)`` adds it (``run``: its function, ``module:name``).
Command = Callable[[str, str, str], argparse.ArgumentParser]
DUMP_HELP = "dump directory (default: skip.<role>.dump_dir's default, ~/.verl/rollout_dump)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skipinject cache", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def command(name: str, run: str, help: str) -> argparse.ArgumentParser:
        """``run``: the command's function (``module:name``), called with the parsed options as keywords."""
        found = sub.add_parser(name, help=help)
        found.set_defaults(run=run)
        return found

    _looking(command)
    _changing(command)
    for name, found in sub.choices.items():
        json_help = "machine-readable output (schema skipinject.cache.ls/1)" if name == "ls" else None
        found.add_argument("--json", action="store_true", dest="as_json", help=json_help)
    return parser


def _looking(command: Command) -> None:
    """The commands that only read: ``ls``, ``verify``, ``show`` and ``diff``."""
    p = command("ls", "ls:cmd_ls", "list projects, layouts, roles and steps: size, age, last use, hits, writer, state")
    p.add_argument("dump_dir", nargs="?", type=location, help=DUMP_HELP + "; or a URL such as s3://bucket/dir")
    p.add_argument("-l", "--steps", action="store_true", help="one line per step instead of per step range")
    p.add_argument(
        "--sort",
        choices=("size", "served", "created", "step"),
        default="step",
        metavar="KEY",
        help="order: size (largest first), served (least recently served first, never served before), "
        "created (oldest first), step (default)",
    )
    p.add_argument("--role", action="append", default=[], help="only this role's steps (repeatable)")
    p.add_argument(
        "--state",
        action="append",
        default=[],
        choices=("complete", "partial", "damaged", "untrusted", "foreign"),
        metavar="STATE",
        help="only steps in this state: complete, partial, damaged, untrusted or foreign (repeatable)",
    )

    p = command(
        "verify", "verify:cmd_verify", "check sizes, checksums and format of every step; exit 1 if any is damaged"
    )
    p.add_argument(
        "paths", nargs="*", type=location, metavar="PATH", help="dump, project, layout or step directories, or URLs"
    )

    p = command(
        "show",
        "show:cmd_show",
        "what one step holds: fields, dtypes, shapes, inputs; rows with prompt, response, score",
    )
    p.add_argument(
        "step_path", type=local_path, metavar="STEP_PATH", help="a step directory (with --match: any directory above)"
    )
    p.add_argument(
        "--match",
        type=local_path,
        metavar="FILE.parquet",
        help="instead: how many of this dataset's prompts have a cached rollout under STEP_PATH",
    )
    p.add_argument("--column", default="prompt", help="the dataset's prompt column for --match (default: prompt)")
    p.add_argument("--rows", type=int, default=3, help="rows to show (default 3)")
    p.add_argument("--tokenizer", metavar="PATH", help="local tokenizer (model directory) to decode token ids")

    p = command("diff", "diff:cmd_diff", "compare two steps, or two runs' project directories; exit 1 if they differ")
    p.add_argument("a", type=local_path, metavar="A")
    p.add_argument("b", type=local_path, metavar="B")
    p.add_argument("--rows", type=int, default=3, help="differing rollout rows to show per step (default 3)")
    p.add_argument("--tokenizer", metavar="PATH", help="local tokenizer (model directory) to decode token ids")


def _changing(command: Command) -> None:
    """The commands that write or remove: ``import``, ``prune``, ``rm`` and ``compact``."""
    p = command(
        "import", "importer:cmd_import", "convert verl's own pickled caches into skipinject's format (needs --trust)"
    )
    p.add_argument("paths", nargs="+", type=local_path, metavar="PATH")
    p.add_argument(
        "--trust", action="store_true", help="load the pickles (they run code when loaded: only caches you trust)"
    )
    p.add_argument(
        "--role", help="role to import as (default: the role declaring the file; of several, the one claiming it)"
    )
    p.add_argument("--experiment", help="trainer.experiment_name, when the directory name is ambiguous")
    p.add_argument("--project", help="trainer.project_name, when the directory name is ambiguous")

    p = command("prune", "prune:cmd_prune", "remove steps and leftovers of interrupted saves (never verl's pickles)")
    p.add_argument("dump_dir", nargs="?", type=location, help=DUMP_HELP + "; or a URL such as s3://bucket/dir")
    p.add_argument("--keep-last", type=int, metavar="N", help="keep the N highest steps of each role")
    p.add_argument(
        "--max-size",
        metavar="SIZE",
        help="remove the least recently served steps (never served: oldest created) until the rest fit in SIZE "
        "(500G, 10M, 1.5T; K, M, G, T are powers of 1024)",
    )
    p.add_argument("--older-than", metavar="AGE", help="remove steps older than AGE (30m, 12h, 7d); see --by")
    p.add_argument(
        "--by",
        choices=("created", "served"),
        default="created",
        metavar="WHAT",
        help="what --older-than measures: when a step was created (default) or last served (created if never)",
    )
    p.add_argument("--partial", action="store_true", help="remove interrupted saves (data without meta.json)")
    p.add_argument("--damaged", action="store_true", help="remove steps whose meta.json or files are damaged")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")

    p = command("rm", "prune:cmd_rm", "remove named steps (never verl's pickles, never a save still running)")
    p.add_argument("steps", nargs="+", type=location, metavar="PATH/STEP", help="step directories, or their URLs")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")

    p = command("compact", "compact:cmd_compact", "store uncompressed steps compressed, in place (each committed anew)")
    p.add_argument("dump_dir", nargs="?", type=local_path, help=DUMP_HELP)
    p.add_argument("--compression", default="zstd", help="zstd (level 1) or zstd-2 .. zstd-22 (default zstd)")
    p.add_argument("--dry-run", action="store_true", help="only say which steps would be compacted")


def main(argv: Sequence[str]) -> int:
    """Entry point of ``skipinject cache``; returns the exit status."""
    from skipinject.cache_tool.common import USAGE, CommandError, escaped_logs, shown
    from skipinject.config import environment
    from skipinject.errors import ConfigError

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        known = ", ".join(commands)
        hint = did_you_mean(argv[0], commands)
        print(f"skipinject cache: error: unknown command {argv[0]!r} (commands: {known}){hint}", file=sys.stderr)
        return USAGE
    try:
        args = vars(parser.parse_args(list(argv)))
    except SystemExit as exc:
        return int(exc.code or 0)
    command, (module, function) = args.pop("command"), args.pop("run").split(":")
    try:
        show_traceback = environment.debug()
    except ConfigError as exc:
        print(f"skipinject cache: error: {exc}", file=sys.stderr)
        return 2
    try:
        with escaped_logs():
            run = getattr(importlib.import_module(f"skipinject.cache_tool.{module}"), function)
            return int(run(**args))
    except (CommandError, SkipInjectError, OSError) as exc:
        print(f"skipinject cache {command}: error: {shown(exc)}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print(f"skipinject cache {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        from skipinject.invocation import missing_dependency

        line = missing_dependency(exc)
        if line is not None:  # this Python lacks what skipinject needs: bad usage, not an internal error
            print(f"skipinject cache {command}: error: {line}", file=sys.stderr)
            return USAGE
        if show_traceback:
            raise
        print(
            f"skipinject cache {command}: internal error: {type(exc).__name__}: {shown(exc)} "
            "(set SKIPINJECT_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return 3
