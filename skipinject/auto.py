"""``import skipinject.auto`` (first, before verl and Hydra read ``sys.argv``): install skipinject from the
program's own command line, for launchers that cannot start through ``python -m skipinject``. The
``skip.<role>.<key>=<value>`` items of ``sys.argv`` are taken out and installed as the runner does.
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
