"""What ``SKIPINJECT_VERL_MATRIX`` chooses: CI (the default) runs one older verl pair, verl 0.6.1's sync
worker-group path with several calls per step (DAPO's recipe); the other pairs of several calls per
step (2-3 min each) are chosen by their id only."""

from __future__ import annotations

import pytest

from tests.verl_matrix import envs
from tests.verl_matrix.pairs import (
    CALL_PAIRS,
    PAIRS,
    V1_PAIRS,
    VERL_BUGS,
    Pair,
    is_chosen,
    selected_versions,
    skip_reason,
)


def _chosen(monkeypatch: pytest.MonkeyPatch, value: str | None) -> list[str]:
    if value is None:
        monkeypatch.delenv("SKIPINJECT_VERL_MATRIX", raising=False)
    else:
        monkeypatch.setenv("SKIPINJECT_VERL_MATRIX", value)
    chosen = selected_versions()
    return [pair.id for pair in PAIRS + CALL_PAIRS + V1_PAIRS if is_chosen(pair, chosen)]


def test_the_default_runs_exactly_one_older_verl_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = _chosen(monkeypatch, None)
    assert chosen == ["0.6.1-sync-dapo"]
    [pair] = [pair for pair in PAIRS + CALL_PAIRS + V1_PAIRS if pair.id == chosen[0]]
    assert pair.version in envs.VERSIONS and pair.version != envs.NEWEST
    assert pair.sync and pair.variant == "dapo", "the worker-group path, several calls per step"
    assert skip_reason(pair, selected_versions()) is None
    assert _chosen(monkeypatch, "  ") == chosen


def test_stack_says_which_verls_ci_runs_and_which_run_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    from packaging.specifiers import SpecifierSet

    from skipinject.verl import stack

    monkeypatch.delenv("SKIPINJECT_VERL_MATRIX", raising=False)
    chosen = selected_versions()
    in_ci = {envs.NEWEST} | {pair.version for pair in PAIRS + CALL_PAIRS + V1_PAIRS if is_chosen(pair, chosen)}
    assert set(stack.VERL_IN_CI) == in_ci
    assert set(stack.VERL_ON_DEMAND) == set(envs.VERSIONS) - in_ci
    assert all(version in SpecifierSet(stack.TESTED["verl"]) for version in envs.VERSIONS)


def test_a_version_picks_its_pairs_but_not_the_call_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _chosen(monkeypatch, "0.6.1") == ["0.6.1", "0.6.1-sync"]
    assert _chosen(monkeypatch, "0.5.0, 0.4.1") == ["0.5.0", "0.4.1"]


def test_a_call_pair_is_chosen_by_its_id(monkeypatch: pytest.MonkeyPatch) -> None:
    wanted = "0.6.1-sync-dapo,0.6.1-sync-remax,0.5.0-dapo"
    assert _chosen(monkeypatch, wanted) == ["0.6.1-sync-dapo", "0.5.0-dapo", "0.6.1-sync-remax"]
    assert _chosen(monkeypatch, "0.6.1-sync") == ["0.6.1-sync"]


def test_a_pair_a_verl_bug_stops_skips_with_that_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = Pair("0.5.0", variant="remax")
    assert broken in CALL_PAIRS and set(VERL_BUGS) == {broken.id}
    assert _chosen(monkeypatch, "0.5.0-remax") == ["0.5.0-remax"]
    reason = skip_reason(broken, selected_versions())
    assert reason is not None and "identical batch size" in reason and "rollout.n > 1" in reason
    assert skip_reason(broken, ("0.5.0",)) == "verl 0.5.0-remax not in SKIPINJECT_VERL_MATRIX"
    every_id = tuple(pair.id for pair in CALL_PAIRS)
    assert [pair.id for pair in CALL_PAIRS if skip_reason(pair, every_id) is None] == [
        "0.6.1-sync-dapo",
        "0.5.0-dapo",
        "0.6.1-sync-remax",
    ]


def test_all_and_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _chosen(monkeypatch, "all") == [pair.id for pair in PAIRS + CALL_PAIRS + V1_PAIRS]
    assert _chosen(monkeypatch, "none") == []


def test_every_pair_has_a_lock_and_the_sync_ones_are_the_worker_group_paths() -> None:
    assert {pair.version for pair in PAIRS + CALL_PAIRS + V1_PAIRS} <= set(envs.VERSIONS) - {envs.NEWEST}
    assert all(envs.lock_file(pair.version).is_file() for pair in PAIRS + CALL_PAIRS + V1_PAIRS)
    assert [pair.id for pair in PAIRS if pair.sync] == ["0.6.1-sync", "0.5.0", "0.4.1"]
    assert all(pair.sync for pair in CALL_PAIRS), "several worker-group calls per step: the sync path"


def test_a_second_build_of_an_env_waits_for_the_first_and_finds_it_built(tmp_path, monkeypatch) -> None:
    """The session's background build and the matrix fixture's build of one env: pip runs once."""
    import threading
    import time

    monkeypatch.setattr(envs, "env_dir", lambda version: tmp_path / f"verl-{version}")
    builds = []

    def slow_build(version: str, *, quiet: bool) -> None:
        builds.append(version)
        time.sleep(0.5)  # the second caller arrives while this one builds
        envs.env_python(version).parent.mkdir(parents=True)
        envs.env_python(version).touch()
        envs._stamp(version).write_text(envs._digest(version))

    monkeypatch.setattr(envs, "_build", slow_build)
    results = []
    callers = [threading.Thread(target=lambda: results.append(envs.build("0.8.0"))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=30)
    assert builds == ["0.8.0"], "the second caller waited and found the env built"
    assert results == [envs.env_python("0.8.0")] * 2


def test_verl_0_9_0_is_an_on_demand_v1_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl 0.9.0's pair (the V1 colocate async warm-up) runs when its version is chosen, never by default."""
    assert [pair.id for pair in V1_PAIRS] == ["0.9.0"]
    assert "0.9.0" not in _chosen(monkeypatch, "")
    assert _chosen(monkeypatch, "0.9.0") == ["0.9.0"]
