"""A served step with and without its weight sync (``skip.rollout.defer_weight_sync``), on the CPU harness.

Real verl 0.9.1 runs of the V0 trainer (``examples/verl_cpu``: a tiny Qwen2, its ``hf`` rollout server
loading every state dict the trainer sends): run 1 generates and caches ``--steps`` steps; then the same
command serves every step from the cache, ``--repeat`` times with ``defer_weight_sync=auto`` and as many
with ``never`` (alternating). Per served step this prints verl's own ``timing_s/step`` (the step's wall
time), ``timing_s/update_weights`` (the sync after the actor update; 0 when deferred) and ``timing_s/gen``,
and each run's syncs (the server's ``weight_sync`` events) and wall time. The tiny model makes the sync
cheap here (its state dict is a few MB); what a sync costs at 7B and 70B: docs/benchmarks.md.

Each run starts Ray and verl (minutes on 2 cores): hold the shared lock on a shared machine.

    python benchmarks/bench_weight_sync.py [--steps 3] [--repeat 1]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "verl_cpu"))

import harness  # noqa: E402

LAUNCHER = (sys.executable, "-m", "skipinject", "-m", "verl.trainer.main_ppo")
_TIMING = re.compile(r"timing_s/(step|update_weights|gen):(-?[0-9.]+(?:e[+-]?[0-9]+)?)")


def step_timings(stdout: str) -> list[dict[str, float]]:
    """Per training step, verl's ``timing_s/step``, ``/update_weights`` and ``/gen`` from the console logger."""
    steps = []
    for line in stdout.splitlines():
        found = {key: float(value) for key, value in _TIMING.findall(line.replace(" ", ""))}
        if "step" in found:
            steps.append(found)
    return steps


def one_run(assets: Any, work: Path, name: str, dump: Path, steps: int, *extra: str) -> dict[str, Any]:
    gen_log = work / f"{name}.gen.jsonl"
    overrides = harness.main_ppo_overrides(
        assets,
        use_v1=False,
        total_steps=steps,
        dump_dir=dump,
        extra=["skip.rollout.enable=True", f"skip.rollout.steps=[1-{steps}]", *extra],
    )
    started = time.perf_counter()
    proc = harness.run_main_ppo(assets, overrides, gen_log=gen_log, launcher=LAUNCHER, timeout=1800)
    wall = time.perf_counter() - started
    (work / f"{name}.stdout.txt").write_text(proc.stdout)
    (work / f"{name}.stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (rc {proc.returncode}); see {work}")
    return {
        "wall": wall,
        "steps": step_timings(proc.stdout),
        "syncs": len(harness.weight_syncs(gen_log)),
        "generated": harness.count_generate_calls(gen_log),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_weight_sync_"))
    work.mkdir(parents=True, exist_ok=True)
    assets = harness.build_assets(work / "assets")
    dump = work / "dump"
    recorded = one_run(assets, work, "record", dump, args.steps)
    print(f"record: {recorded['syncs']} syncs, {recorded['generated']} sequences generated, {recorded['wall']:.1f} s")
    runs: dict[str, list[dict[str, Any]]] = {"auto": [], "never": []}
    for index in range(args.repeat):
        for policy in ("auto", "never"):
            name = f"{policy}{index}"
            runs[policy].append(
                one_run(assets, work, name, dump, args.steps, f"skip.rollout.defer_weight_sync={policy}")
            )

    print(f"\n{args.steps} served steps per run, {args.repeat} run(s) each; medians over every served step")
    print("| defer_weight_sync | syncs per run | step s | update_weights s | gen s | run wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for policy, done in runs.items():
        steps = [step for run in done for step in run["steps"]]
        print(
            f"| {policy} | {statistics.median(run['syncs'] for run in done):.0f} "
            f"| {statistics.median(s['step'] for s in steps):.3f} "
            f"| {statistics.median(s.get('update_weights', 0.0) for s in steps):.3f} "
            f"| {statistics.median(s.get('gen', 0.0) for s in steps):.3f} "
            f"| {statistics.median(run['wall'] for run in done):.1f} |"
        )
        if any(run["generated"] for run in done):
            print(f"  (note: {policy} generated sequences: a step was not served)")
    print(f"\noutputs in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
