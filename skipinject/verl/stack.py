"""The verl stack (torch, tensordict, ray, verl) against the versions tested: not dependencies (installing
skipinject must never replace a CUDA torch); at start, one warning when the installed ones are outside it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from skipinject.verl.compat import installed_version

logger = logging.getLogger("skipinject")

#: The verls CI runs (``make test``): 0.9.1, every test; 0.6.1, one pair of real runs of DAPO's recipe
#: on the sync worker-group path, several generation calls per step (``tests/verl_matrix/pairs.py``).
VERL_IN_CI = ("0.9.1", "0.6.1")
#: The verls with pairs of real runs on demand (``SKIPINJECT_VERL_MATRIX``), not in CI; when each pair last
#: ran, and how it ended: ``tests/verl_matrix/results.json``.
VERL_ON_DEMAND = ("0.9.0", "0.8.0", "0.7.1", "0.5.0", "0.4.1")
#: Releases inside the range checked at start that no test runs: their targets are read from their code only.
VERL_READ_FROM_CODE: tuple[str, ...] = ()
#: The versions tested, in CI or on demand (the locks in ``requirements/``; torch, tensordict, ray: the 0.9.1 lock's).
TESTED: Mapping[str, str] = {
    "verl": ">=0.4.1,<0.10",
    "torch": ">=2.13,<2.14",
    "tensordict": ">=0.10,<0.11",
    "ray": ">=2.60,<2.61",
}
#: Needed by every cache (the codecs); the others may be absent (a program that is not verl).
REQUIRED = ("torch",)


@dataclass(frozen=True)
class Component:
    name: str
    installed: str | None
    tested: str

    @property
    def in_range(self) -> bool:
        """A local or pre-release build counts as its release (``2.13.0+cu128``, NGC's ``2.13.0a0+git...``)."""
        if self.installed is None:
            return False
        try:
            release = Version(Version(self.installed).base_version)
            return SpecifierSet(self.tested).contains(release)
        except (InvalidSpecifier, InvalidVersion):
            return False

    def describe(self) -> str:
        if self.installed is None:
            return f"{self.name} (not installed)"
        if self.in_range:
            return f"{self.name} {self.installed}"
        return f"{self.name} {self.installed} (untested: tested {self.tested})"


def components(lookup: Callable[[str], str | None] = installed_version) -> list[Component]:
    return [Component(name, lookup(name), tested) for name, tested in TESTED.items()]


def outside_tested(found: list[Component]) -> list[Component]:
    """Installed packages outside their tested range, and required ones that are missing."""
    return [c for c in found if not c.in_range and (c.installed is not None or c.name in REQUIRED)]


def warning_text(found: list[Component]) -> str | None:
    """The one start-up warning for ``found``, or ``None`` when the stack is as tested."""
    outside = outside_tested(found)
    if not outside:
        return None
    tested = ", ".join(f"{name} {spec}" for name, spec in TESTED.items())
    have = ", ".join(
        f"{c.name} not installed (it comes with verl)" if c.installed is None else f"{c.name} {c.installed}"
        for c in outside
    )
    return (
        f"this environment has {have}: outside the versions skipinject is tested with ({tested}); "
        "skipinject leaves them as they are and runs, but if a role misbehaves, report it with the output "
        "of `python -m skipinject --version`"
    )


def warn_if_untested(lookup: Callable[[str], str | None] = installed_version) -> str | None:
    """Log the start-up warning (one line), if any; return it."""
    text = warning_text(components(lookup))
    if text is not None:
        logger.warning("%s", text)
    return text
