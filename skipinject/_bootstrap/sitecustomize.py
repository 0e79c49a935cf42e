"""Starts skipinject in every Python process of a run (this directory is first on PYTHONPATH), as
coverage.py's subprocess support; another ``sitecustomize`` on the path is loaded first. Standard library
only, it imports skipinject at the first import of a ``triggers`` package (e.g. ``verl``), as ddtrace's
``when_imported``; ``ray`` is watched too, to hand the configuration on through ``ray.init``.
"""

import importlib.machinery
import os
import sys

# ``importlib.util`` (with contextlib, functools) is imported only where needed: this module runs in every
# process of a run, and most of them never import a watched package.


def _load_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    search = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", search)
    if spec is None or spec.loader is None:
        return
    from importlib.util import module_from_spec

    module = module_from_spec(spec)
    ours = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module  # ``import sitecustomize`` later finds the user's, as without us
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # mirror site.py: report, go on
        if ours is not None:
            sys.modules["sitecustomize"] = ours
        print(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback: {exc}", file=sys.stderr)


_TRIGGERS_KEY = '"triggers":['


def _triggers(text: str) -> "list[str] | None":
    """The packages whose import starts skipinject; ``None``: start now (no or unreadable list)."""
    quick = _plain_triggers(text)
    if quick is not None:
        return quick
    import json

    try:
        if text.startswith("z1:"):
            import base64
            import zlib

            text = zlib.decompressobj().decompress(base64.b85decode(text[3:]), 1 << 22).decode()
        triggers = json.loads(text).get("triggers")
    except Exception:
        return None  # the full start reports what is wrong with the configuration
    return triggers if isinstance(triggers, list) and triggers and all(isinstance(t, str) for t in triggers) else None


def _plain_triggers(text: str) -> "list[str] | None":
    """The trigger list read without ``json`` (most processes of a run import no target package: this is all
    they pay), when the configuration holds it once as a list of plain names; else ``None``."""
    if text.count(_TRIGGERS_KEY) != 1:
        return None
    start = text.index(_TRIGGERS_KEY) + len(_TRIGGERS_KEY)
    end = text.find("]", start)
    names = [item.strip() for item in text[start:end].split(",")] if end > start else []
    if not names or not all(len(n) > 2 and n[0] == n[-1] == '"' and n[1:-1].isidentifier() for n in names):
        return None
    return [n[1:-1] for n in names]


class _StartOnImport:
    """A meta-path finder that runs a callback right after a watched top-level package is imported."""

    def __init__(self, packages: "list[str]") -> None:
        self.pending = set(packages)
        self.finding: set[str] = set()  # the packages being searched for below (it does not come back here)

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name not in self.pending or name in self.finding:
            return None
        from importlib.util import find_spec

        self.finding.add(name)
        try:
            spec = find_spec(name)
        finally:
            self.finding.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _FireAfterExec(spec.loader, self)  # type: ignore[assignment]
        return spec

    def fire(self, name: str) -> None:
        self.pending.discard(name)
        if not self.pending or name != "ray":
            self.pending.clear()
            if self in sys.meta_path:  # type: ignore[comparison-overlap]
                sys.meta_path.remove(self)  # type: ignore[arg-type]
        _start_skipinject(hand_on_only=name == "ray" and bool(self.pending))


class _FireAfterExec:
    """The real loader (a spec only looked up keeps it, runpy asks it for code), and the finder's callback
    once the module has run (the real loader is put back)."""

    def __init__(self, loader: object, finder: _StartOnImport) -> None:
        self.loader = loader
        self.finder = finder

    def exec_module(self, module: object) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # type: ignore[attr-defined]
        self.loader.exec_module(module)  # type: ignore[attr-defined]
        self.finder.fire(module.__name__)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.loader, name)


def _start() -> None:
    text = os.environ.get("SKIPINJECT_CONFIG")
    if not text:
        return
    triggers = _triggers(text)
    if triggers is not None and not any(t in sys.modules for t in triggers):
        sys.meta_path.insert(0, _StartOnImport([*triggers, "ray"]))  # type: ignore[arg-type]
    else:
        _start_skipinject()


def _start_skipinject(hand_on_only: bool = False) -> None:
    try:
        from skipinject.bootstrap import start_from_env

        start_from_env(hand_on_only)
    except Exception as exc:  # never break the user's process
        print(f"skipinject: not active in process {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)


_load_next_sitecustomize()
_start()
