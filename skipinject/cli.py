"""``python -m skipinject [options] (SCRIPT | -m MODULE | -c CODE) [ARGS...]`` — run a program with hooks.

The program runs as ``python SCRIPT ARGS`` would (``sys.argv``, ``sys.path``, ``__main__``, exit code,
traceback); ``skip.<role>.<key>=value`` items are taken out of ARGS first. A mistake in what the user gave
is one line and status 2 (:func:`main`); a module that cannot be found is one line and status 1.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.machinery
import importlib.util
import os
import re
import runpy
import shlex
import sys
import textwrap
import types
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, TracebackType
from typing import Any, NoReturn

from skipinject.errors import SkipInjectError, UsageError, did_you_mean

USAGE = """\
python -m skipinject [options] (SCRIPT | -m MODULE | -c CODE) [ARGS...]
       python -m skipinject cache COMMAND [...]
       (`skipinject` is the same command as `python -m skipinject`)"""

DESCRIPTION = """\
Run a Python program (typically verl's trainer) as python would, with skipinject's hooks installed:
  python -m skipinject -m verl.trainer.main_ppo skip.rollout.enable=True skip.rollout.steps=[1,2,3]"""


@dataclass(frozen=True)
class Program:
    """What to run, as python's command line names it: a script, ``-m`` a module or ``-c`` code."""

    kind: str  # "script", "module" or "code"
    target: str
    args: list[str]


class _Parser(argparse.ArgumentParser):
    """argparse, its errors raised as one-line :class:`UsageError` (with a "did you mean")."""

    def error(self, message: str) -> NoReturn:
        unknown = message.partition("unrecognized arguments: ")[2].split()
        options = [name for action in self._actions for name in action.option_strings]
        hint = did_you_mean(unknown[0], options) if unknown else ""
        raise UsageError(f"{message}{hint} (options go before SCRIPT, -m MODULE or -c CODE; see --help)")

    def format_help(self) -> str:
        self.epilog = _epilog()  # built only when asked for: it reads the cache tool's commands
        return super().format_help()


class _Once(argparse.Action):
    """An option given at most once (argparse would keep the last and ignore the first in silence)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, *_: Any) -> None:
        if getattr(namespace, self.dest) is not None:
            raise argparse.ArgumentError(self, "given twice (the first would be ignored); give it once")
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    """The runner's command line: options, then the program and its ARGS (``argparse.REMAINDER``)."""
    parser = _Parser(
        prog="python -m skipinject",
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=22, width=100),
        allow_abbrev=False,
    )
    for flag, metavar, meaning in (
        ("--plugins", "LIST", "plugins to load (instead of VERL_SKIP_PLUGINS): names, module[:attr], -name to exclude"),
        ("--skip-config", "FILE", "YAML file with a top-level `skip:` mapping of role settings (ARGS win)"),
    ):
        parser.add_argument(flag, metavar=metavar, help=meaning, action=_Once)
    for flag, meaning in (
        ("--list", "show plugins, their roles and targets, and whether each target exists here; then exit"),
        ("--version", "show the versions of skipinject, its plugin API, each plugin and verl's stack; then exit"),
    ):
        parser.add_argument(flag, action="store_true", help=meaning)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("-m", dest="module", action="store_true", help=argparse.SUPPRESS)  # see "commands"
    which.add_argument("-c", dest="code", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("program", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _epilog() -> str:
    """Every command, setting source and environment variable, from their declarations."""
    from skipinject.cache_tool import build_parser as cache_parser
    from skipinject.config.environment import VARIABLES
    from skipinject.config.schema import ROLE_KEYS, choices

    sub = next(a for a in cache_parser()._actions if isinstance(a, argparse._SubParsersAction))
    keys = ", ".join(f"{key} ({'|'.join(choices(key))})" if choices(key) else key for key in ROLE_KEYS)
    wrap = textwrap.TextWrapper(100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(
        [
            "commands:",
            "  SCRIPT [ARGS...]    run a script as `python SCRIPT ARGS` would",
            "  -m MODULE [ARGS...] run a module as `python -m MODULE ARGS` would",
            "  -c CODE [ARGS...]   run code as `python -c CODE ARGS` would",
            *(f"  {'cache ' + c.dest:<18}  {c.help}" for c in sub._choices_actions),
            "  (`python -m skipinject cache COMMAND --help` shows each command's options)",
            "",
            "settings skip.<role>.<key>=<value>, from (the later wins):",
            "  --skip-config FILE  a YAML file: `skip: {<role>: {<key>: <value>}}`",
            "  ARGS                skip.<role>.<key>=<value>, also +skip... and ++skip... as Hydra writes them:",
            "                      taken out of ARGS, validated before the program starts, never passed on",
            *wrap.wrap("keys: " + keys + "."),
            "",
            "environment variables:",
            *(f"  {name:<30} {meaning}" for name, meaning in VARIABLES.items()),
            "  (object stores take their credentials from their own variables, through fsspec)",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``skipinject`` and ``python -m skipinject``: the one error boundary."""
    if argv is None:
        _console_script_path()
        argv = sys.argv[1:]
    if argv[:1] == ["cache"]:
        from skipinject.cache_tool import main as cache_main

        return cache_main(argv[1:])
    try:
        program = _prepare(list(argv))
    except SkipInjectError as exc:
        print(f"skipinject: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # this Python lacks what skipinject needs: how to go on, not a traceback
        from skipinject.invocation import missing_dependency

        line = missing_dependency(exc)
        if line is None:
            raise
        print(f"skipinject: error: {line}", file=sys.stderr)
        return 2
    return 0 if program is None else _run(program)


def _console_script_path() -> None:
    """As the ``skipinject`` console script: the current directory first on ``sys.path``, as ``python -m``."""
    if _safe_path() or not sys.path:
        return
    if sys.path[0] == os.path.dirname(os.path.realpath(sys.argv[0])) and Path(sys.argv[0]).name != "__main__.py":
        sys.path[0] = os.getcwd()


def _attach_values(argv: list[str]) -> list[str]:
    """``--plugins -name`` -> ``--plugins=-name`` (argparse would read ``-name`` as an option), up to the program."""
    joined: list[str] = []
    words = iter(argv)
    for word in words:
        if word in ("--plugins", "--skip-config"):
            value = next(words, None)
            joined.append(word if value is None else f"{word}={value}")
        else:
            joined.append(word)
            if not word.startswith("-") or word in ("-m", "-c"):
                joined.extend(words)  # the program and its ARGS: never rewritten
    return joined


def _prepare(argv: list[str]) -> Program | None:
    """Parse, validate, load the plugins and start the hooks; the program to run (``None``: done)."""
    args = build_parser().parse_args(_attach_values(argv))
    if args.version:
        from skipinject.listing import render_versions

        print(render_versions(), end="")
        return None
    from skipinject.config import environment
    from skipinject.config.overrides import split_overrides

    environment.check()
    program = _program(args, argv[: len(argv) - len(args.program)])
    overrides, rest = split_overrides(program.args if program else [])
    if program is not None:
        program = Program(program.kind, program.target, rest)
    chosen = args.list or args.skip_config or args.plugins is not None or environment.ENV_PLUGINS in os.environ
    if not chosen and not overrides:  # no setting names a role: none can be on, so no plugin is loaded
        return _required(program)
    from skipinject.bootstrap import install, resolve

    plugins, config = resolve(overrides, plugins=args.plugins, settings_file=args.skip_config)
    if args.list:
        from skipinject.listing import render

        print(render(plugins), end="")
        return None
    program = _required(program)
    install(config, plugins)
    return program


def _program(args: argparse.Namespace, options: Sequence[str] = ()) -> Program | None:
    """The program named after the options (a missing script refused, as python does; ``options``: the words
    before it, for the corrected command when settings come first)."""
    words = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not words:
        if args.module or args.code:
            raise UsageError(f"{'-m' if args.module else '-c'} needs {'a module name' if args.module else 'code'}")
        return None
    kind = "module" if args.module else "code" if args.code else "script"
    if kind == "script" and words[0] != "-" and not os.path.exists(words[0]):  # ``-``: read from stdin
        raise UsageError(_settings_first(words, options) or f"can't open file {words[0]!r}: no such file")
    return Program(kind, words[0], words[1:])


#: A ``key=value`` setting as Hydra (and skipinject's ``skip.*``) takes it, with Hydra's ``+``/``++``/``~``.
_SETTING = re.compile(r"^(\+{1,2}|~)?[A-Za-z_][A-Za-z0-9_.\-]*=")


def _settings_first(words: Sequence[str], options: Sequence[str]) -> str | None:
    """The one line for settings put before the program (python would take the first for a script's name),
    with the command in the right order; ``None`` when ``words`` do not start with a setting."""
    count = next((i for i, word in enumerate(words) if not _SETTING.match(word)), len(words))
    if count == 0:
        return None
    settings, rest = list(words[:count]), list(words[count:])
    if not rest:
        return f"{words[0]} is a setting, not a program: give a SCRIPT, -m MODULE or -c CODE before the settings"
    command = " ".join(shlex.quote(word) for word in ["python", "-m", "skipinject", *options, *rest, *settings])
    return f"{words[0]} comes before the program: settings go after it, among its ARGS: {command}"


def _required(program: Program | None) -> Program:
    if program is None:
        raise UsageError("give a SCRIPT, -m MODULE or -c CODE to run (see --help)")
    return program


def _run(program: Program) -> int:
    """Run the program as ``python`` would: ``SystemExit`` passes, an exception is printed from the
    program's first frame (status 1), a module runpy cannot find is one line."""
    try:
        _execute(program)
    except KeyboardInterrupt as exc:  # python's own exit (by SIGINT), its traceback from the program's frames
        interrupt, frames, hook = exc, _program_frames(exc.__traceback__), sys.excepthook
        sys.excepthook = lambda kind, value, tb: (
            hook(kind, value.with_traceback(frames), frames) if value is interrupt and frames else hook(kind, value, tb)
        )
        raise
    except Exception as exc:
        frames = _program_frames(exc.__traceback__)
        if frames is None and isinstance(exc, ImportError):
            print(f"skipinject: error: {exc}", file=sys.stderr)
        else:
            sys.excepthook(type(exc), exc.with_traceback(frames), frames)
        return 1
    return 0


def _execute(program: Program) -> None:
    sys.argv = [program.target if program.kind != "code" else "-c", *program.args]
    if program.kind == "module":  # runpy sets argv[0] to the module's file, as ``python -m`` does
        runpy.run_module(program.target, {"__builtins__": builtins}, run_name="__main__", alter_sys=True)
        return
    if program.kind == "code" or program.target == "-":  # no file: the working directory is not asked for
        if not _safe_path():
            sys.path[0] = ""
        source = program.target if program.kind == "code" else sys.stdin.read()
        _run_as_main(compile(source, "<string>" if program.kind == "code" else "<stdin>", "exec"))
        return
    script = os.path.abspath(program.target)  # python's ``__file__`` and tracebacks name it so
    packed = os.path.isdir(script) or zipfile.is_zipfile(script)
    if not _safe_path():  # python's first sys.path entry (runpy puts a folder's or zip's there itself)
        if packed:
            del sys.path[0]
        else:
            sys.path[0] = os.path.dirname(script)
    source = b"" if packed else Path(script).read_bytes()
    if packed or source.startswith(importlib.util.MAGIC_NUMBER):  # a folder or zip with __main__.py, compiled code
        runpy.run_path(program.target, run_name="__main__")
    else:
        _run_as_main(compile(source, script, "exec"), script)


def _run_as_main(code: CodeType, file: str | None = None) -> None:
    """Execute ``code`` as the ``__main__`` module, as python runs ``-c`` code or a script."""
    main_module = types.ModuleType("__main__")
    main_module.__dict__["__builtins__"] = builtins  # the module, as python's own ``__main__`` has it
    if file is not None:
        main_module.__file__ = file
        main_module.__loader__ = importlib.machinery.SourceFileLoader("__main__", file)
        main_module.__dict__["__cached__"] = None
    sys.modules["__main__"] = main_module
    exec(code, main_module.__dict__)


def _safe_path() -> bool:
    """``python -P`` (3.11+): python put no directory of the program's first on ``sys.path``."""
    return bool(getattr(sys.flags, "safe_path", False))


_OURS = (__file__, runpy.__file__, "<frozen runpy>")


def _program_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the program's first frame on (``None``: it never started)."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in _OURS or tb.tb_frame.f_code.co_filename.startswith("<frozen importlib")
    ):
        tb = tb.tb_next
    return tb
