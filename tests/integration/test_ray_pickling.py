"""Ray pickles classes by value (a ``__main__`` task runner, an ``@ray.remote`` class whose module name
holds the actor class): with every built-in and shipped role enabled, verl's task runners and every
patched target's owner pickle as Ray pickles them (``ray.cloudpickle``, by value), and a process loading
them gets its own wrappers back (skipinject active there) or verl's originals (not active) -- also
through the wrapper Ray puts around each actor method, so the fully async trainer's ``fit`` is still the
reward role's clock in the trainer actor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

ROLES = ("rollout", "rollout_tq", "async_rollout", "reward", "advantage")
#: The task runners verl 0.9.1 ships (the separation trainer has none of its own).
RUNNERS = (
    "verl.trainer.main_ppo:TaskRunnerV1",
    "verl.trainer.main_ppo_v0:TaskRunner",
    "verl.experimental.one_step_off_policy.main_ppo:OneStepTaskRunner",
    "verl.experimental.fully_async_policy.fully_async_main:FullyAsyncTaskRunner",
)
#: Modules whose classes the runners reach, imported so that every target is patched.
MODULES = (
    "verl.trainer.main_ppo",
    "verl.experimental.fully_async_policy.fully_async_rollouter",
    "verl.trainer.ppo.v1.trainer_base",
    "verl.trainer.ppo.v1.replay_buffer",
    "verl.experimental.separation.ray_trainer",
    "verl.experimental.one_step_off_policy.ray_trainer",
    "verl.experimental.fully_async_policy.fully_async_trainer",
)
#: The fully async trainer's fit overrides RayPPOTrainer.fit (the reward role's clock).
OVERRIDE = ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer", "fit")

DUMP = """
import importlib, json, sys, types
import skipinject
roles = json.loads(sys.argv[2])
assert skipinject.enable(*[f"skip.{r}.enable=True" for r in roles], *[f"skip.{r}.steps=[1,2]" for r in roles])
import ray.cloudpickle as cloudpickle
from skipinject import injector
INJECTOR, PICKLING_OWNER = injector.INJECTOR, getattr(injector, "PICKLING_OWNER", None)

for name in json.loads(sys.argv[3]):
    importlib.import_module(name)

def by_value(module, thing):
    cloudpickle.register_pickle_by_value(module)  # what Ray does to __main__
    try:
        return cloudpickle.dumps(thing)
    finally:
        cloudpickle.unregister_pickle_by_value(module)

report, blobs = {"failed": {}, "pickled": [], "unpatched": []}, {}
owners = [(spec, *spec.split(":")) for spec in json.loads(sys.argv[4])]
for key, patch in list(INJECTOR._patches.items()):
    if patch.owner == PICKLING_OWNER:
        continue
    if not patch.applied:
        report["unpatched"].append(key)
        continue
    owner = patch.path.qualname.rpartition(".")[0]
    owners.append((key, patch.path.module, owner or patch.path.qualname))
for key, module_name, qualname in owners:
    module = importlib.import_module(module_name)
    thing = module
    for part in qualname.split("."):
        thing = getattr(thing, part)
    try:
        blobs[key] = by_value(module, thing).hex()
        report["pickled"].append(key)
    except Exception as exc:
        report["failed"][key] = f"{type(exc).__name__}: {exc}"
from ray.util.tracing.tracing_helper import _inject_tracing_into_class

module = importlib.import_module(sys.argv[5])
modified = getattr(module, sys.argv[6]).__ray_metadata__.modified_class
_inject_tracing_into_class(modified)  # what creating the actor does: each method in a wrapper of Ray's
blobs["override"] = by_value(module, modified).hex()
json.dump({"report": report, "blobs": blobs}, open(sys.argv[1], "w"))
"""

LOAD = """
import json, sys
if sys.argv[2] == "on":
    import skipinject
    roles = json.loads(sys.argv[3])
    assert skipinject.enable(*[f"skip.{r}.enable=True" for r in roles], *[f"skip.{r}.steps=[1,2]" for r in roles])
import ray.cloudpickle as cloudpickle
from skipinject.injector import SkipinjectWrapper
blobs = json.load(open(sys.argv[1]))["blobs"]
failed = {}
for key, blob in blobs.items():
    try:
        cloudpickle.loads(bytes.fromhex(blob))
    except Exception as exc:
        failed[key] = f"{type(exc).__name__}: {exc}"
import asyncio
from ray.util.tracing.tracing_helper import _inject_tracing_into_class
from skipinject.clock import CLOCK

actor = cloudpickle.loads(bytes.fromhex(blobs["override"]))
_inject_tracing_into_class(actor)  # what loading the actor class does
trainer = actor.__mro__[1]
fit = trainer.__dict__[sys.argv[4]]
instance = object.__new__(actor)
instance.message_queue_client = None  # fit stops at once: "MessageQueue client not set"
try:
    asyncio.run(getattr(actor, sys.argv[4])(instance))  # as Ray's actor-method executor calls it
except ValueError:
    pass
print(json.dumps({"failed": failed, "trainer": trainer.__name__, "wrapped": isinstance(fit, SkipinjectWrapper),
                  "clock": CLOCK.instance is instance}))
"""


def _python(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("SKIPINJECT_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def pickled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    pytest.importorskip("verl.experimental.fully_async_policy.fully_async_main")
    out = tmp_path_factory.mktemp("pickles") / "pickles.json"
    module, cls, _ = OVERRIDE
    _python(DUMP, str(out), json.dumps(ROLES), json.dumps(MODULES), json.dumps(RUNNERS), module, cls)
    return out, json.loads(out.read_text())["report"]


def test_task_runners_and_patched_owners_pickle_by_value(pickled: tuple[Path, dict[str, object]]) -> None:
    _, report = pickled
    assert report["failed"] == {}
    pickled_keys = set(report["pickled"])  # type: ignore[arg-type]
    assert set(RUNNERS) <= pickled_keys
    assert "verl.trainer.ppo.reward:extract_reward" in pickled_keys
    assert "verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit" in pickled_keys  # the reward role's clock
    assert "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample" in pickled_keys
    assert report["unpatched"] == []


def test_a_loading_process_gets_its_own_wrapper_or_the_original(pickled: tuple[Path, dict[str, object]]) -> None:
    out, _ = pickled
    method = OVERRIDE[2]
    active = json.loads(_python(LOAD, str(out), "on", json.dumps(ROLES), method).splitlines()[-1])
    # the trainer's fit, called through Ray's wrapper, is the reward role's clock in the actor's process
    assert active == {"failed": {}, "trainer": "FullyAsyncTrainer", "wrapped": True, "clock": True}
    plain = json.loads(_python(LOAD, str(out), "off", "[]", method).splitlines()[-1])
    assert plain == {"failed": {}, "trainer": "FullyAsyncTrainer", "wrapped": False, "clock": False}
