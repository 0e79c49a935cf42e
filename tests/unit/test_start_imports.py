"""What a run's other processes pay before a target runs: a process started with the runner's configuration
imports, when verl's module is patched, only what patching needs; the cache code comes with the first call
that does not pass straight through. Every Ray worker and helper process of a run patches verl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import skipinject

BOOTSTRAP = str(Path(skipinject.__file__).parent / "_bootstrap")

#: The skipinject modules a process may hold once verl's agent loop is patched (and before a target runs).
ALLOWED_BEFORE_A_CALL = {
    "skipinject",
    "skipinject._version",
    "skipinject.bootstrap",
    "skipinject.clock",
    "skipinject.codecs",
    "skipinject.config",
    "skipinject.config.environment",
    "skipinject.config.schema",
    "skipinject.config.steps",
    "skipinject.engine",
    "skipinject.engine.background",
    "skipinject.engine.phases",
    "skipinject.errors",
    "skipinject.injector",
    "skipinject.node",
    "skipinject.payload",
    "skipinject.plugin_kit",
    "skipinject.plugin_manager",
    "skipinject.report",
    "skipinject.report.silence",  # the never-called watch is installed with the patches
    "skipinject.report.tally",
    "skipinject.roles",
    "skipinject.text",
    "skipinject.verl",
    "skipinject.verl.builtin_guard",
    "skipinject.verl.codecs",
    "skipinject.verl.compat",
    "skipinject.verl.tensordicts",
    "skipinject_rollout",
    "skipinject_rollout.common",
    "skipinject_rollout.legacy",
    "skipinject_rollout.rollout",
    "skipinject_rollout.weight_sync",
}
#: What serving or saving a step needs: none of it before a call.
CACHE_CODE = {
    "skipinject.engine.runtime",
    "skipinject.engine.replay",
    "skipinject.engine.record",
    "skipinject.engine.book",
    "skipinject.engine.steps",
    "skipinject.engine.matching",
    "skipinject.store.step_store",
    "skipinject.store.tensorfile",
    "skipinject.store.garbage",
    "skipinject.report.misses",
    "skipinject.cache_tool.common",
    "skipinject.config.overrides",  # the runner reads overrides and files; a child only its exported settings
    "skipinject.dump_root",  # a dump_dir parsed at the first call
    "skipinject.store",  # the cache's files: read and written by the runtime only
    "skipinject.store.files",
    "skipinject.store.format",
    "skipinject_rollout.rescore",  # a hit's re-scoring and a recording's reward identity
    "skipinject_rollout.reward_identity",
}
#: Third-party packages nothing of skipinject imports before a call (a real run's verl may have some already).
HEAVY_PACKAGES = {
    "omegaconf",
    "importlib_metadata",
    "packaging",
    "torch",
    "tensordict",
    "fsspec",
    "zstandard",
    "numcodecs",
    "pyarrow",
    "ray",
}

AGENT_LOOP = """
class AgentLoopManager:
    def generate_sequences(self, prompts):
        return ("generated", prompts.meta_info)
"""

PROBE = """
import json, sys
at_start = set(sys.modules)
import verl
after_verl = sorted(m for m in sys.modules if m.startswith("skipinject"))
import verl.experimental.agent_loop.agent_loop as agent_loop
before = sorted(m for m in sys.modules if m.startswith("skipinject"))
others = sorted({m.partition(".")[0] for m in set(sys.modules) - at_start} - {"verl"})
patched = type(vars(agent_loop.AgentLoopManager)["generate_sequences"]).__name__
class Batch:
    meta_info = {"global_steps": 1, "validate": True}
result = agent_loop.AgentLoopManager().generate_sequences(Batch())
after = sorted(m for m in sys.modules if m.startswith("skipinject"))
print(json.dumps({"after_verl": after_verl, "before": before, "others": others, "patched": patched,
                  "result": list(result), "after": after}))
"""


def fake_verl(root: Path) -> None:
    """A ``verl`` package holding the rollout role's target (the unit tier imports no real verl)."""
    package = root / "verl" / "experimental" / "agent_loop"
    package.mkdir(parents=True)
    for directory in (root / "verl", root / "verl" / "experimental", package):
        (directory / "__init__.py").write_text("")
    (package / "agent_loop.py").write_text(AGENT_LOOP)


def runner_config(tmp_path: Path) -> str:
    """``SKIPINJECT_CONFIG`` as the runner exports it for a rollout run."""
    code = "import os; print(os.environ['SKIPINJECT_CONFIG'])"
    args = ["skip.rollout.enable=True", "skip.rollout.steps=[1-3]", f"skip.rollout.dump_dir={tmp_path / 'dump'}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    out = subprocess.run(
        [sys.executable, "-m", "skipinject", "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[0]


def test_a_child_patches_verl_without_importing_the_cache_code(tmp_path: Path) -> None:
    fake_verl(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP", "PYTHONPATH"))}
    env.update(SKIPINJECT_CONFIG=runner_config(tmp_path), PYTHONPATH=os.pathsep.join([BOOTSTRAP, str(tmp_path)]))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["patched"] == "SkipinjectWrapper"  # skipinject is active: the target is patched
    for stage in ("after_verl", "before"):  # verl imported (skipinject starts), then its agent loop (patched)
        before = set(seen[stage])
        assert before <= ALLOWED_BEFORE_A_CALL, (
            f"{stage}: imported before a call: {sorted(before - ALLOWED_BEFORE_A_CALL)}"
        )
        assert not before & CACHE_CODE, f"{stage}: cache code imported before a call: {sorted(before & CACHE_CODE)}"
    assert "skipinject.engine" in seen["after_verl"]  # started at verl's import
    heavy = set(seen["others"]) & HEAVY_PACKAGES
    assert not heavy, f"third-party packages imported before a call: {sorted(heavy)} (all new: {seen['others']})"
    # the first call builds the role's runtime (a validation batch: the original runs)
    assert seen["result"] == ["generated", {"global_steps": 1, "validate": True}]
    assert "skipinject.engine.runtime" in seen["after"]
