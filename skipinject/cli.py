"""``python -m skipinject [options] (SCRIPT | -m MODULE) [ARGS...]`` — run a program with hooks.

The program runs as ``python SCRIPT ARGS`` would (same ``sys.argv``, ``__main__``, exit code and
tracebacks). ``skip.<role>.<key>=value`` items (also ``+skip...`` / ``++skip...``) are taken out
of ARGS, validated before the program starts, and never reach it.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from skipinject.config.schema import settings_help
from skipinject.errors import SkipInjectError

if TYPE_CHECKING:
    from skipinject.plugin_manager import PluginSet

USAGE = """\
usage: python -m skipinject [--plugins LIST] [--skip-config FILE] [--list] [--version]
                            (SCRIPT | -m MODULE | -c CODE) [ARGS...]
       python -m skipinject cache {ls,verify,show,diff,import,prune} ...

Run a Python program (typically verl's trainer) with skipinject's hooks installed:
  python -m skipinject -m verl.trainer.main_ppo skip.rollout.enable=True skip.rollout.steps=[1,2,3] ...

options:
  --plugins LIST  plugins to load (overrides VERL_SKIP_PLUGINS): names, module[:attr], -name to exclude
  --skip-config FILE
                  YAML file with a top-level `skip:` mapping of role settings (the command line wins)
  -c CODE         run CODE as `python -c` would
  --list          show plugins, their roles and targets, and whether each target exists here; then exit
  --version       show the versions of skipinject, its plugin API, each plugin and verl's stack; exit
  -h, --help      show this help and exit

""" + settings_help()


class UsageError(SkipInjectError):
    """The runner's own command line is wrong."""


def _parse(argv: Sequence[str]) -> tuple[dict[str, str | bool], str | None, str | None, list[str]]:
    """Options, then SCRIPT, ``-m MODULE`` or ``-c CODE`` (returned as the script ``-c`` with options["code"])."""
    options: dict[str, str | bool] = {}
    args = list(argv)
    while args:
        arg = args[0]
        if arg in ("-h", "--help"):
            options["help"] = True
            return options, None, None, []
        if arg == "--version":
            options["version"] = True
            args.pop(0)
        elif arg == "--list":
            options["list"] = True
            args.pop(0)
        elif arg.split("=", 1)[0] in ("--plugins", "--skip-config"):
            args.pop(0)
            name = arg.split("=", 1)[0]
            if name[2:] in options:
                raise UsageError(f"{name} given twice (the first would be ignored); give it once")
            if "=" in arg:
                options[name[2:]] = arg.split("=", 1)[1]
            elif args:
                options[name[2:]] = args.pop(0)
            else:
                raise UsageError(f"{name} needs a value")
        elif arg == "-c" or (arg.startswith("-c") and len(arg) > 2):
            code = arg[2:] if len(arg) > 2 else (args[1] if len(args) > 1 else None)
            if code is None:
                raise UsageError("-c needs a program text")
            options["code"] = code
            return options, None, None, args[1:] if len(arg) > 2 else args[2:]
        elif arg == "-m":
            if len(args) < 2:
                raise UsageError("-m needs a module name")
            return options, None, args[1], args[2:]
        elif arg.startswith("-m") and len(arg) > 2:
            return options, None, arg[2:], args[1:]
        elif arg == "--":
            args.pop(0)
            break
        elif arg.startswith("-"):
            raise UsageError(f"unknown option {arg!r} (options go before SCRIPT or -m MODULE)")
        else:
            break
    if not args:
        return options, None, None, []
    return options, args[0], None, args[1:]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``skipinject`` and ``python -m skipinject``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cache"]:
        from skipinject.cache_tool import main as cache_main

        return cache_main(argv[1:])
    try:
        options, script, module, program_args = _parse(argv)
    except UsageError as exc:
        print(f"skipinject: error: {exc}", file=sys.stderr)
        return 2
    if options.get("help"):
        print(USAGE, end="")
        return 0
    if options.get("version"):
        from skipinject.listing import render_versions

        print(render_versions(), end="")
        return 0

    from skipinject.config.overrides import split_overrides

    code = options.get("code")
    from skipinject.config.environment import ENV_PLUGINS

    chosen = options.get("list") or options.get("skip-config") or options.get("plugins") or ENV_PLUGINS in os.environ
    if not chosen:
        try:
            overrides, rest = split_overrides(program_args)
        except SkipInjectError as exc:
            print(f"skipinject: error: {exc}", file=sys.stderr)
            return 2
        if not overrides:  # no setting names a role: none can be on, so no plugin is loaded or installed
            from skipinject.config import environment

            try:
                environment.check()
                if script is None and module is None and not isinstance(code, str):
                    raise UsageError("give a SCRIPT, -m MODULE or -c CODE to run (see --help)")
            except SkipInjectError as exc:
                print(f"skipinject: error: {exc}", file=sys.stderr)
                return 2
            return _run(script, module, rest, code if isinstance(code, str) else None)

    from skipinject import bootstrap
    from skipinject.config import Config, apply_overrides, apply_settings, environment, load_file
    from skipinject.plugin_manager import load_plugins

    selection = options.get("plugins")
    selection_text = str(selection) if isinstance(selection, str) else os.environ.get(ENV_PLUGINS)
    try:
        environment.check()
        plugins = load_plugins(selection_text or "")
        if options.get("list"):
            from skipinject.listing import render

            print(render(plugins), end="")
            return 0
        if script is None and module is None and not isinstance(code, str):
            raise UsageError("give a SCRIPT, -m MODULE or -c CODE to run (see --help)")
        hint = "; see `python -m skipinject --list`"
        config = Config()
        settings_file = options.get("skip-config")
        if isinstance(settings_file, str):
            config = apply_settings(config, load_file(settings_file), plugins.roles, hint=hint)
        overrides, program_args = split_overrides(program_args)
        config = apply_overrides(config, overrides, plugins.roles, hint=hint)
        owners = sorted({plugins.plugin_of(name).name for name in config.enabled_roles})
        config = Config(
            plugins=",".join(owners),
            plugin_sources=plugins.sources_of(owners),
            roles=config.roles,
            triggers=_triggers(plugins, config.enabled_roles),
        )
        if config.enabled_roles:
            config.to_json()  # refuses, in one line, what cannot reach the run's other processes
    except SkipInjectError as exc:
        print(f"skipinject: error: {exc}", file=sys.stderr)
        return 2

    bootstrap.configure_logging()
    if config.enabled_roles and not bootstrap.disabled():
        from skipinject.verl.stack import warn_if_untested

        warn_if_untested()
        bootstrap.export(config)
        _export_plugin_paths(plugins, owners)
        try:
            engine = bootstrap.start(config, plugins)
            if engine is not None:
                engine.check_targets()
        except SkipInjectError as exc:
            print(f"skipinject: error: {exc}", file=sys.stderr)
            return 2
    return _run(script, module, program_args, code if isinstance(code, str) else None)


def _triggers(plugins: PluginSet, enabled: list[str]) -> tuple[str, ...]:
    """Top-level packages holding the enabled roles' targets and clocks (and verl's SkipManager guard)."""
    from skipinject.verl.builtin_guard import BUILTIN_SKIP_INIT

    paths = [BUILTIN_SKIP_INIT] if any(plugins.roles[name].builtin for name in enabled) else []
    for name in enabled:
        role = plugins.roles[name]
        paths += [target.path for target in role.targets] + list(role.clocks)
    return tuple(sorted({path.split(":")[0].split(".")[0] for path in paths}))


def _export_plugin_paths(plugins: PluginSet, names: list[str]) -> None:
    """Plugins given as ``module[:attr]`` paths must import in children too (Ray workers start
    elsewhere than the current directory): append their directories to ``PYTHONPATH``."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for plugin in plugins.plugins:
        if plugin.name not in names or plugin.distribution is not None:
            continue
        top = sys.modules.get(plugin.source.split(":")[0].split(".")[0])
        location = getattr(top, "__file__", None)
        if location is None:
            continue
        base = Path(location).resolve().parent
        if Path(location).name == "__init__.py":
            base = base.parent
        if str(base) not in paths:
            paths.append(str(base))
    if paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)


def _run(script: str | None, module: str | None, args: list[str], code: str | None = None) -> int:
    """Run the program as ``python`` would; its SystemExit and exceptions pass through."""
    if code is not None:
        import types

        sys.argv = ["-c", *args]
        if sys.path[:1] != [""]:
            sys.path.insert(0, "")
        main_module = types.ModuleType("__main__")
        main_module.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main_module
        exec(compile(code, "<string>", "exec"), main_module.__dict__)
        return 0
    if module is not None:
        sys.argv = [module, *args]  # runpy sets argv[0] to the module's file, as ``python -m`` does
        if sys.path and sys.path[0] != os.getcwd():
            sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    assert script is not None
    if not os.path.exists(script):
        print(f"skipinject: error: can't open file {script!r}: no such file", file=sys.stderr)
        return 2
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0
