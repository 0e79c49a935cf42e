"""skipinject on verl's ``neo`` tree, whose V0 trainer runs on the NeoProto data plane
(``trainer.data_plane=neoproto``: the trainer's batches are ``verl.experimental.neoproto`` DataProtos,
columns referenced in Ray's object store). Opt-in: ``SKIPINJECT_VERL_NEO`` names the python of an
environment holding that tree (``docs/verl-versions.md`` says how to build one); unset, the test skips.

One pair of real ``python -m skipinject -m verl.trainer.main_ppo`` GRPO runs on CPU into one dump_dir,
``skip.rollout`` on steps 1-2: run 1 generates and records both steps from the NeoProto batches, run 2
makes 0 generator calls and trains on the served steps: every row the trainer dumps
(``trainer.rollout_data_dir``: prompt, response, score, per step) and every score and advantage
statistic it logs is the same in both runs. Run 3, on the same tree with the classic data plane
(``trainer.data_plane=classic``, classic ``DataProto`` batches), is served the NeoProto recording the
same way: the one cache format serves either data plane.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import harness, skip_lines
from tests.e2e.test_rollout_e2e import trained_metrics

pytestmark = [pytest.mark.e2e]

NEO_ENV = "SKIPINJECT_VERL_NEO"
NEO_CLASS = "verl.experimental.neoproto.views.data_proto.DataProto"


def neo_python() -> Path:
    """The neo environment's python, or a skip saying why the pair does not run."""
    python = os.environ.get(NEO_ENV, "").strip()
    if not python:
        pytest.skip(f"{NEO_ENV} is not set: the pair on verl's neo tree (NeoProto data plane) runs on demand")
    probe = subprocess.run(
        [python, "-c", "import verl.experimental.neoproto"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        pytest.skip(f"{NEO_ENV}={python} has no verl.experimental.neoproto: not verl's neo tree")
    return Path(python)


@dataclass
class NeoRuns:
    tmp: Path
    dump: Path
    procs: list[Any]
    calls: list[int]
    rows: list[dict[int, list[dict[str, Any]]]]


def dumped_rows(directory: Path) -> dict[int, list[dict[str, Any]]]:
    """Per step, the rows the trainer trained on as ``trainer.rollout_data_dir`` holds them (``{step}.jsonl``),
    without the per-run keys (a random ``uid`` and the time)."""
    steps = {}
    for path in sorted(directory.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        steps[int(path.stem)] = [{k: v for k, v in row.items() if k not in ("uid", "request_id")} for row in rows]
    return steps


@pytest.fixture(scope="module")
def neo_runs(tmp_path_factory: pytest.TempPathFactory) -> NeoRuns:
    python = neo_python()
    from tests.e2e.test_verl_matrix import assets_for

    tmp = tmp_path_factory.mktemp("verl-neo")
    assets = assets_for(python, tmp / "assets")
    dump = tmp / "dump"
    procs, calls, rows = [], [], []
    for run, plane in (("run1", "neoproto"), ("run2", "neoproto"), ("run3", "classic")):
        gen_log, generations = tmp / f"{run}.gen.jsonl", tmp / f"{run}.rollouts"
        overrides = harness.main_ppo_overrides(
            assets,
            use_v1=False,
            total_steps=2,
            dump_dir=dump,
            verl=harness.verl_version(python),
            extra=[
                f"trainer.data_plane={plane}",
                "skip.rollout.enable=True",
                "skip.rollout.steps=[1,2]",
                f"trainer.rollout_data_dir={generations}",
            ],
        )
        proc = harness.run_main_ppo(
            assets,
            overrides,
            gen_log=gen_log,
            launcher=(str(python), "-m", "skipinject", "-m", "verl.trainer.main_ppo"),
            timeout=900,
            env_extra={"RAY_DEDUP_LOGS": "0"},
        )
        (tmp / f"{run}.stdout.txt").write_text(proc.stdout)
        (tmp / f"{run}.stderr.txt").write_text(proc.stderr)
        assert proc.returncode == 0, f"neo {run} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        procs.append(proc)
        calls.append(
            sum(int(r.get("n_sequences", 1)) for r in harness.generate_calls(gen_log) if not r.get("validate"))
        )
        rows.append(dumped_rows(generations))
    return NeoRuns(tmp, dump, procs, calls, rows)


def test_neoproto_rollout_recorded_then_served(neo_runs: NeoRuns) -> None:
    first, second, classic = neo_runs.procs
    for proc in (first, second):
        assert f"data_proto_cls={NEO_CLASS}" in proc.stdout + proc.stderr, "the trainer runs on NeoProto"
    assert "data_proto_cls=verl.protocol.DataProto" in classic.stdout + classic.stderr
    layout = harness.cache_dir(neo_runs.dump)
    assert sorted(p.name for p in layout.iterdir() if p.name.isdigit()) == ["1", "2"]
    lines = skip_lines(first, "rollout")
    assert any("rollout step 1: miss" in line for line in lines), lines
    assert neo_runs.calls[0] > 0

    # Run 2: both steps served, the generator never called, the trainer's union and later steps accept them.
    assert neo_runs.calls[1] == 0
    lines = skip_lines(second, "rollout")
    assert sum("hit, served step" in line for line in lines) == 2, lines
    assert not any("other inputs" in line for line in lines), lines


def test_a_neoproto_recording_serves_the_classic_data_plane(neo_runs: NeoRuns) -> None:
    assert neo_runs.calls[2] == 0
    lines = skip_lines(neo_runs.procs[2], "rollout")
    assert sum("hit, served step" in line for line in lines) == 2, lines
    generated, served = neo_runs.rows[0], neo_runs.rows[2]
    for step in (1, 2):  # the same rows; each data plane balances its batch on its own
        assert sorted(map(json.dumps, served[step])) == sorted(map(json.dumps, generated[step])), step
    assert trained_metrics(neo_runs.procs[2]) == trained_metrics(neo_runs.procs[0])


def test_neoproto_served_rows_are_the_generated_ones(neo_runs: NeoRuns) -> None:
    generated, served = neo_runs.rows[:2]
    assert sorted(generated) == [1, 2] and sorted(served) == [1, 2], (sorted(generated), sorted(served))
    for step in (1, 2):
        assert generated[step], f"step {step}: nothing dumped"
        assert served[step] == generated[step], f"step {step}: the trainer saw other rows when served"
    first, second = (trained_metrics(proc) for proc in neo_runs.procs[:2])
    assert len(first) == 2 and first == second
