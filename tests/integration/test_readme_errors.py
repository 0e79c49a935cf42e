"""The README's troubleshooting quotes the runner's one-line errors as the runner prints them: each
quoted line (``…`` standing for a list or detail) is what one of these mistakes prints, with exit 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.unit.test_readme_facts import section

#: Mistakes a user makes, as (arguments after ``python -m skipinject``, environment variables added).
MISTAKES: list[tuple[list[str], dict[str, str]]] = [
    (["-c", "pass", "skip.rollout.enabel=True"], {}),
    (["-c", "pass", "skip.rollout.action=skip"], {}),
    (["-c", "pass", "skip.rolout.enable=True"], {}),
    (["--plugins", "rolout", "-c", "pass", "skip.rollout.enable=True"], {}),
    (["-c", "pass", "skip.reward.enable=True", "skip.reward.action=match"], {}),
    (["-c", "pass", "skip.rollout.enable=True", "skip.rollout.dump_dir=foo://x"], {}),
    (["-c", "pass"], {"SKIPINJECT_DISABLE": "maybe"}),
    (["train.py", "skip.rollout.enable=True"], {}),
    (["skip.rollout.enable=True", "-m", "verl.trainer.main_ppo"], {}),
    # a Python without skipinject's dependencies (-S: no site-packages), running it from a clone
    (["-S", "-c", "pass", "skip.rollout.enable=True"], {"PYTHONPATH": str(ROOT)}),
]


def quoted_errors() -> list[str]:
    """The error lines of the README's troubleshooting, as quoted there."""
    text = section((ROOT / "README.md").read_text(), "## Troubleshooting")
    return re.findall(r"^\| `(skipinject: error: [^`]*)`", text, re.M)


def test_every_error_the_readme_quotes_is_what_the_runner_prints(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    printed = []
    for args, extra in MISTAKES:
        flags = args[:1] if args[:1] == ["-S"] else []  # python's own: before -m
        run = subprocess.run(
            [sys.executable, *flags, "-m", "skipinject", *args[len(flags) :]],
            cwd=tmp_path,
            env={**base, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2, (args, run.stderr)
        assert run.stdout == "" and len(run.stderr.splitlines()) == 1, (args, run.stderr)
        printed.append(run.stderr.strip())

    quoted = quoted_errors()
    assert len(quoted) == len(MISTAKES), "an error row was added or removed: add the mistake that prints it"
    for line in quoted:
        pattern = ".*".join(re.escape(piece) for piece in line.split("…"))
        assert any(re.fullmatch(pattern, out) for out in printed), f"no mistake prints the README's {line!r}:\n" + (
            "\n".join(printed)
        )
