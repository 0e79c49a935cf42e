"""Loads ``verl_cpu_shim`` right after ``verl`` is imported, in every process of a harness run.

verl 0.6 and newer import the shim themselves (``VERL_USE_EXTERNAL_MODULES``, read by
``verl/__init__.py``); verl 0.4 and 0.5 have no such extension point. The harness puts this
directory on ``PYTHONPATH``: the first ``import verl`` of a process then imports the shim, unless
verl already did. Standard library only; another ``sitecustomize`` on the path (skipinject's loads
this one) is loaded first, as ``site`` would have.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _load_next_sitecustomize() -> None:
    # Only the path entries after this directory: one before it (skipinject's) is what loaded this one.
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    if here not in entries:
        return
    search = sys.path[len(entries) - entries[::-1].index(here) :]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", search)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # mirror site.py: report, go on
        print(f"Error in sitecustomize ({spec.origin}): {exc}", file=sys.stderr)


class _ShimAfterVerl:
    """A meta-path finder: wraps verl's loader so that the shim is imported once verl has run."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != "verl" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader)  # type: ignore[assignment]
        return spec


class _Loader:
    def __init__(self, loader: object) -> None:
        self.loader = loader

    def create_module(self, spec: object) -> object:
        return self.loader.create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module: object) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # type: ignore[attr-defined]
        self.loader.exec_module(module)  # type: ignore[attr-defined]
        for finder in [f for f in sys.meta_path if isinstance(f, _ShimAfterVerl)]:
            sys.meta_path.remove(finder)
        if "verl_cpu_shim" not in sys.modules and os.environ.get("VERL_USE_EXTERNAL_MODULES") == "verl_cpu_shim":
            import verl_cpu_shim  # noqa: F401  (registers and patches on import)

    def __getattr__(self, name: str) -> object:
        return getattr(self.loader, name)


_load_next_sitecustomize()
if "verl" not in sys.modules:
    sys.meta_path.insert(0, _ShimAfterVerl())  # type: ignore[arg-type]
