"""Starts skipinject in every Python process of a run (this directory is put on PYTHONPATH).

The runner exports the resolved configuration in ``SKIPINJECT_CONFIG``; any Python process
started from it (Ray workers, multiprocessing children, subprocesses) imports this module at
start-up, like coverage.py's subprocess support. Another ``sitecustomize`` on the path is
loaded first, so installing skipinject never hides the user's or the distribution's own.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _load_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    search = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", search)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # mirror site.py: report, go on
        print(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback: {exc}", file=sys.stderr)


_load_next_sitecustomize()

if os.environ.get("SKIPINJECT_CONFIG"):
    try:
        from skipinject.bootstrap import start_from_env

        start_from_env()
    except Exception as exc:  # never break the user's process
        print(f"skipinject: not active in process {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)
