"""``import skipinject.auto``: install skipinject from the program's own command line, for launchers that
cannot start through ``python -m skipinject`` (a notebook kernel, a job system's fixed entry point).

The ``skip.<role>.<key>=<value>`` items of ``sys.argv`` (also ``+skip…``, ``++skip…``) are taken out, as
the runner takes them out of ARGS, and :func:`skipinject.enable` installs them; a wrong one is one line on
stderr and exit status 2, as under the runner. Without such items nothing happens. Import it first, before
verl and Hydra read ``sys.argv``.
"""

from __future__ import annotations

import sys


def _enable_from_argv() -> None:
    from skipinject.bootstrap import enable
    from skipinject.config.overrides import split_overrides
    from skipinject.errors import SkipInjectError

    try:
        overrides, rest = split_overrides(sys.argv[1:])
        if overrides:
            sys.argv[1:] = rest
            enable(*(f"{key}={value}" for key, value in overrides))
    except SkipInjectError as exc:
        print(f"skipinject: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


_enable_from_argv()
