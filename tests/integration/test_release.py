"""Built like a release: every distribution's sdist (from the tree) and wheel (from that sdist) is
clean, carries its licence and metadata, and shares skipinject's one version; the core's wheel holds
the built-in roles and registers them through its entry points; ``pip install .`` from a clone brings
them too. (Installing the wheels into a verl environment and running verl: ``tests/e2e/test_install.py``.)"""

from __future__ import annotations

import email
import os
import subprocess
import sys
import tarfile
import zipfile
from configparser import ConfigParser
from pathlib import Path

import pytest

from skipinject import __version__
from tests.integration.release import ROOT, Release, build_release

BUILT_IN = {
    "rollout": "skipinject_rollout.rollout",
    "async_rollout": "skipinject_rollout.async_rollout",
    "rollout_tq": "skipinject_rollout_tq.plugin",
}
STACK = ("torch", "tensordict", "ray", "verl")
NOT_SHIPPED = ("tests", ".venv", ".venvs", "__pycache__", "benchmarks", "examples", "docs", "requirements")


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Release]:
    return build_release(tmp_path_factory.mktemp("dist"))


def _sdist_names(release: Release) -> list[str]:
    with tarfile.open(release.sdist) as archive:
        return [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]


def _wheel(release: Release) -> zipfile.ZipFile:
    return zipfile.ZipFile(release.wheel)


def _metadata(release: Release) -> email.message.Message:
    with _wheel(release) as wheel:
        [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(wheel.read(name))


def test_every_distribution_is_built(release: dict[str, Release]) -> None:
    assert set(release) == {"skipinject", "reward", "advantage"}, "the built-in roles are no distributions of their own"
    for built in release.values():
        assert (
            built.sdist.name.endswith(f"-{__version__}.tar.gz") and f"-{__version__}-py3-none-any" in built.wheel.name
        )


def test_sdists_are_clean_and_complete(release: dict[str, Release]) -> None:
    for name, built in release.items():
        names = _sdist_names(built)
        shipped = [n for n in names if set(Path(n).parts) & set(NOT_SHIPPED) or n.endswith(".pyc")]
        assert not shipped, f"{name}: {shipped}"
        assert {"LICENSE", "pyproject.toml", "PKG-INFO"} <= set(names), name
    core = _sdist_names(release["skipinject"])
    assert {"README.md", "CHANGELOG.md", "skipinject/py.typed", "skipinject/_bootstrap/sitecustomize.py"} <= set(core)
    for module in BUILT_IN.values():
        package, leaf = module.split(".")
        assert any(n.endswith(f"{package}/{leaf}.py") for n in core), module


def test_core_wheel_holds_and_registers_the_built_in_roles(release: dict[str, Release]) -> None:
    with _wheel(release["skipinject"]) as wheel:
        names = wheel.namelist()
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        parser = ConfigParser()
        parser.read_string(wheel.read(entry_points).decode())
    assert dict(parser["skipinject.plugins"]) == BUILT_IN
    assert parser["console_scripts"]["skipinject"] == "skipinject.cli:main"
    for module in BUILT_IN.values():
        assert module.replace(".", "/") + ".py" in names, module
    assert {"skipinject/py.typed", "skipinject_rollout/py.typed", "skipinject_rollout_tq/py.typed"} <= set(names)
    assert not [n for n in names if set(Path(n).parts) & set(NOT_SHIPPED) or n.endswith(".pyc")]


def test_metadata_licence_urls_classifiers_and_one_version(release: dict[str, Release]) -> None:
    for name, built in release.items():
        meta = _metadata(built)
        assert meta["Version"] == __version__, f"{name}: the version comes from skipinject/_version.py"
        assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE", name
        with _wheel(built) as wheel:
            assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel.namelist()), name
        urls = dict(url.split(", ", 1) for url in meta.get_all("Project-URL", []))
        assert {"Homepage", "Repository", "Issues"} <= set(urls), f"{name}: {urls}"
        assert meta.get_all("Classifier"), name
        requires = [r.split(";")[0].strip() for r in meta.get_all("Requires-Dist", [])]
        stack = [r for r in requires if r.split(">")[0].split("=")[0].split("<")[0].strip().lower() in STACK]
        assert not stack, f"{name} declares {stack}: pip could replace the environment's own"
    core = _metadata(release["skipinject"])
    assert "Typing :: Typed" in core.get_all("Classifier")
    assert set(core.get_all("Provides-Extra")) == {"fast", "remote", "s3"}
    assert "Changelog" in dict(url.split(", ", 1) for url in core.get_all("Project-URL"))
    for plugin in ("reward", "advantage"):
        assert "skipinject>=0.1" in _metadata(release[plugin]).get_all("Requires-Dist")


def test_pip_install_from_a_clone_brings_the_built_in_roles(tmp_path: Path) -> None:
    """``pip install .`` (here into a target directory, dependencies already present) is enough."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), "."],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    env["PYTHONPATH"] = str(site)  # before the set-up's editable install
    where = subprocess.run(
        [sys.executable, "-c", "import skipinject, skipinject_rollout, skipinject_rollout_tq as m; print(m.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(site)), where.stdout
    listing = subprocess.run(
        [sys.executable, "-m", "skipinject", "--list"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listing.returncode == 0, listing.stderr[-3000:]
    for name in BUILT_IN:
        assert f"plugin {name} (skipinject {__version__})" in listing.stdout, listing.stdout
    assert "FAILED" not in listing.stdout and "[missing" not in listing.stdout, listing.stdout
