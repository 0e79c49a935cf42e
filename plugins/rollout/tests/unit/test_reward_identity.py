"""The reward's identity changes exactly when a score can: every deciding setting (wherever it sits), the
reward file's whole content and the local modules it imports, the code of a Python object in the config (a
class, a lambda, a partial) and not its address; a file that cannot be read is a marker that re-scores.
No verl: the run configs are plain OmegaConf trees shaped like verl's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from skipinject import RescorePolicy
from skipinject_rollout import rescore
from skipinject_rollout.reward_identity import UNREADABLE, file_digest, local_modules, reward_identity

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 0.5\n"


def config(path: Path | str | None, **reward: Any) -> Any:
    tree: dict[str, Any] = {
        "reward": {
            "num_workers": 2,
            "custom_reward_function": {"path": None if path is None else str(path), "name": "compute_score"},
            "reward_manager": {"source": "register", "name": "naive"},
            "reward_model": {"enable": False, "strategy": "fsdp", "fsdp_config": {"param_offload": False}},
        },
        "data": {"reward_fn_key": "data_source"},
    }
    config = OmegaConf.create(tree)
    for key, value in reward.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def digest(path: Path | str | None, **reward: Any) -> str:
    identity = reward_identity(config(path, **reward))
    assert identity is not None
    return str(identity["digest"])


def served_as_recorded(recorded: Any, current: Any) -> bool:
    decision = rescore.decide(RescorePolicy.auto, {"reward": reward_identity(recorded)}, reward_identity(current))
    return not decision.rescore


def test_reward_kwargs_decide_wherever_they_sit(tmp_path: Path) -> None:
    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    for key in (
        "reward.custom_reward_function.reward_kwargs.scale",
        "reward.reward_kwargs.max_resp_len",
        "reward.reward_model.strategy.reward_kwargs.scale",  # a mapping under a name that is a scalar in verl
    ):
        assert not served_as_recorded(config(reward, **{key: 0.5}), config(reward, **{key: 2.0})), key
    # tuning stays out: where or how fast a score is computed
    assert digest(reward) == digest(reward, **{"reward.num_workers": 8, "reward.reward_model.strategy": "megatron"})
    assert digest(reward) == digest(reward, **{"reward.reward_model.fsdp_config.param_offload": True})


def test_the_local_modules_a_reward_file_imports_decide(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    reward = tmp_path / "r.py"
    reward.write_text("import helper\nfrom pkg import rules\nimport json\n" + REWARD)
    (tmp_path / "helper.py").write_text("SCALE = 1\n")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "rules.py").write_text("from . import deeper\n")
    (tmp_path / "pkg" / "deeper.py").write_text("X = 1\n")
    found = local_modules(str(reward))
    assert sorted(found) == ["helper.py", "pkg/__init__.py", "pkg/deeper.py", "pkg/rules.py"], found
    before = digest(reward)
    recorded = config(reward)
    identity_before = reward_identity(recorded)
    (tmp_path / "pkg" / "deeper.py").write_text("X = 2\n")
    assert digest(reward) != before, "a module imported by a module the reward imports decides"
    why = rescore.decide(RescorePolicy.auto, {"reward": identity_before}, reward_identity(config(reward))).why
    assert "pkg/deeper.py, a module it imports" in why, why
    after = digest(reward)
    (tmp_path / "unrelated.py").write_text("Y = 1\n")
    assert digest(reward) == after, "a file beside it that no import names does not"


def test_a_reward_file_of_any_size_is_digested_by_its_content(tmp_path: Path) -> None:
    reward = tmp_path / "big.py"
    with reward.open("wb") as handle:  # 80 MiB, sparse: cheap to write, read whole
        handle.truncate(80 << 20)
    first = file_digest(str(reward))
    with reward.open("r+b") as handle:
        handle.seek(70 << 20)
        handle.write(b"x")
    stat = reward.stat()
    os.utime(reward, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file_digest(str(reward)) != first, "a change past 64 MiB changes the digest, whatever the mtime"
    assert not first.startswith(UNREADABLE)


def test_an_unreadable_or_missing_reward_file_forces_rescoring(tmp_path: Path) -> None:
    missing = config(tmp_path / "gone.py")
    assert reward_identity(missing)["files"]["reward.custom_reward_function.path"]["sha256"].startswith(UNREADABLE)
    assert not served_as_recorded(missing, missing), "the same unreadable file twice is no proof of the same reward"
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    assert file_digest(str(fifo)) == f"{UNREADABLE}: not a regular file"  # and it does not hang
    why = rescore.decide(RescorePolicy.auto, {"reward": reward_identity(missing)}, reward_identity(missing)).why
    assert "cannot be read" in why and "gone.py" in why


class Scaled:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, solution_str: str) -> float:
        return self.scale * len(solution_str)


def test_a_class_based_reward_is_identified_by_its_code(tmp_path: Path) -> None:
    namespace: dict[str, Any] = {"__name__": "user_reward"}  # loaded by path: in no sys.modules
    for body in ("return 1.0", "return 2.0"):
        exec(f"class Reward:\n    def __call__(self, s):\n        {body}\n", namespace)
        namespace[body] = namespace["Reward"]
    one, two = namespace["return 1.0"], namespace["return 2.0"]
    assert repr(one) == repr(two), "the old identity (a repr) could not tell them apart"
    rule = "reward.reward_manager.custom"
    plain = OmegaConf.create({}, flags={"allow_objects": True})
    a, b = plain.copy(), plain.copy()
    OmegaConf.update(a, rule, one, force_add=True)
    OmegaConf.update(b, rule, two, force_add=True)
    assert reward_identity(a)["digest"] != reward_identity(b)["digest"]
    c, d = plain.copy(), plain.copy()
    OmegaConf.update(c, rule, Scaled(1.0), force_add=True)
    OmegaConf.update(d, rule, Scaled(2.0), force_add=True)
    assert reward_identity(c)["digest"] != reward_identity(d)["digest"], "an instance's attributes decide"


IDENTITY_IN_A_CHILD = """
import functools, json, sys
from omegaconf import OmegaConf
from skipinject_rollout.reward_identity import reward_identity
scale = float(sys.argv[1])
def score(s, factor):
    return factor * len(s)
config = OmegaConf.create({}, flags={"allow_objects": True})
OmegaConf.update(config, "reward.fn", lambda s: scale * len(s) * (s in {"alpha", "beta", "gamma"}), force_add=True)
OmegaConf.update(config, "reward.words", {"alpha", "beta", "gamma", "delta"}, force_add=True)
OmegaConf.update(config, "reward.partial", functools.partial(score, factor=scale), force_add=True)
print(reward_identity(config)["digest"])
"""


def test_a_lambda_and_a_partial_are_stable_across_processes_and_follow_their_bound_values() -> None:
    seeds: list[str] = []

    def child(scale: str) -> str:
        seed = str(len(seeds))  # another hash seed in each child: set and frozenset orders differ
        seeds.append(seed)
        done = subprocess.run(
            [sys.executable, "-c", IDENTITY_IN_A_CHILD, scale],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert child("1.0") == child("1.0"), "the same code and bound values: the same reward in every process"
    assert child("1.0") != child("2.0"), "another bound value: another reward"


def test_the_recorded_identity_is_json(tmp_path: Path) -> None:
    reward = tmp_path / "r.py"
    reward.write_text("import helper\n" + REWARD)
    (tmp_path / "helper.py").write_text("")
    identity = reward_identity(config(reward))
    assert json.loads(json.dumps(identity)) == identity
    assert identity["files"]["reward.custom_reward_function.path"]["modules"] == {
        "helper.py": file_digest(str(tmp_path / "helper.py"))
    }


@pytest.mark.parametrize("setting", ["reward.reward_model.model_path"])
def test_a_model_directory_is_named_by_its_path(tmp_path: Path, setting: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    identity = reward_identity(config(None, **{setting: str(model)}))
    assert setting not in identity["files"] and identity["settings"][setting] == str(model)
    assert served_as_recorded(config(None, **{setting: str(model)}), config(None, **{setting: str(model)}))


EVIL_KEY = "reward.evil\x1b]0;owned\x07\nskipinject ERROR: forged line"


@pytest.mark.parametrize("key", [EVIL_KEY, "reward." + "k" * (1 << 20)])
def test_a_recorded_settings_key_is_printed_escaped_and_bounded(key: str) -> None:
    """A forged identity's key in the run's line: no escape code, no second line, not a megabyte."""
    import io
    import logging
    import types

    from skipinject import bootstrap

    recorded = reward_identity(config(None))
    assert recorded is not None
    forged = {**recorded, "digest": "forged", "settings": {**recorded["settings"], key: 1}}
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("skipinject")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not the attribute: it clears the logger's isEnabledFor cache
    filters = list(logger.filters)
    bootstrap.bound_log_lines()
    try:
        call = types.SimpleNamespace(run_config=config(None))
        done = rescore.apply(None, call, "rollout", 2, None, [({"reward": forged}, None)])  # type: ignore[arg-type]
        assert done.rows == 0
        settings = types.SimpleNamespace(rescore=RescorePolicy.never)
        rescore.apply(None, call, "rollout", 3, settings, [({"reward": forged}, None)])  # type: ignore[arg-type]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.filters[:] = filters  # no state left for other tests
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines  # auto: re-scored (nothing to score here); never: served, with a warning
    for line in lines:
        assert "\x1b" not in line and "\x07" not in line and len(line) < 400, line[:400]
        assert "another reward.evil" in line or "another reward.kkk" in line or "…" in line, line
