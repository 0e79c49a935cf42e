"""At the start of a run, every enabled role that cannot act in this install says so once (never a crash)."""

from __future__ import annotations

from pathlib import Path

from skipinject import Role, StepSource, Target
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine


def engine_for(tmp_path: Path, *targets: Target) -> Engine:
    role = Role(name="probe", targets=list(targets), step=StepSource.argument("step"))
    settings = RoleConfig(enable=True, steps=(1,), dump_dir=str(tmp_path))
    engine = Engine(Config(roles={"probe": settings}), {"probe": (role, "probe")})
    engine.start()
    return engine


def test_a_target_in_a_missing_module_is_one_warning(tmp_path: Path, caplog) -> None:
    engine = engine_for(tmp_path, Target("json:dumps"), Target("si_no_such_pkg.moved.module:Manager.generate"))
    try:
        lines = engine.check_targets()
    finally:
        engine.stop()
    assert len(lines) == 1 and "si_no_such_pkg.moved.module:Manager.generate does not exist" in lines[0]
    assert any(lines[0] in r.getMessage() for r in caplog.records)


def test_a_role_without_a_target_for_this_verl_is_one_warning(tmp_path: Path) -> None:
    engine = engine_for(tmp_path, Target("json:dumps", verl=">=99"))
    try:
        (line,) = engine.check_targets()
    finally:
        engine.stop()
    assert line.startswith("skip.probe is enabled but has no target for the installed verl") and ">=99" in line


def test_module_lookup_imports_nothing() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from skipinject.verl.compat import module_exists; "
        "print(module_exists('xml.dom.minidom'), module_exists('xml.no_such'), module_exists('si_none.x'), "
        "'xml.dom' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "False", "False"]
