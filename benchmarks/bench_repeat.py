"""``action=repeat`` over many cached steps: finding the nearest must not read every step.

Builds a project with N cached steps (one real save, copied N times with each copy's meta.json
rewritten for its step), then times the decision for a step above all of them (the nearest below
is served) and counts the meta.json reads it made. Before names-only listing, every decision read
and validated all N meta.json files.

    python benchmarks/bench_repeat.py [--steps 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import results
from skipinject import Payload, Role, StepSource, Target
from skipinject.config import RoleConfig
from skipinject.engine.runtime import RoleRuntime
from skipinject.roles import Call
from skipinject.store import StepStore
from skipinject.store.format import meta_digest


class JsonCodec:
    def encode(self, result: Any) -> Payload:
        return Payload(objects={"v": result}, rows=1)

    def decode(self, payload: Payload, call: Any) -> Any:
        return payload.objects["v"]


def build(project: Path, steps: int) -> StepStore:
    store = StepStore(project, "bench", {})
    store.save(0, JsonCodec().encode({"step": 0}), {})
    template = project / "0"
    meta = json.loads((template / "meta.json").read_text())
    for step in range(1, steps):
        target = project / str(step)
        shutil.copytree(template, target)
        meta.update(step=step, global_steps=step)
        meta["meta_checksum"] = meta_digest(meta)
        (target / "meta.json").write_text(json.dumps(meta))
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    results.add_argument(parser)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp)
        started = time.perf_counter()
        build(dump / "skipinject_default" / "bench", args.steps)
        built = time.perf_counter() - started
        role = Role(name="bench", targets=[Target("json:dumps")], step=StepSource.argument("step"), codec=JsonCodec())
        runtime = RoleRuntime(
            role, RoleConfig(enable=True, steps=(args.steps + 5,), dump_dir=str(dump), action="repeat"), "bench"
        )
        reads = {"n": 0}
        real = StepStore.read_meta

        def counting(self: StepStore, step: int, **options: Any) -> Any:
            reads["n"] += 1
            return real(self, step, **options)

        StepStore.read_meta = counting  # type: ignore[method-assign]
        call = Call("json:dumps", json.dumps, None, (), {})
        started = time.perf_counter()
        plan = runtime.plan(call, args.steps + 5)
        elapsed = time.perf_counter() - started
        StepStore.read_meta = real  # type: ignore[method-assign]
        store = StepStore(dump / "skipinject_default" / "bench", "bench", {})
        started = time.perf_counter()
        [s for s in store.step_numbers_on_disk() if store.is_committed(s)]  # the old way: every meta.json read
        every = time.perf_counter() - started
    print(
        f"repeat over {args.steps} cached steps (built in {built:.1f} s): decision in {elapsed * 1000:.1f} ms, "
        f"served step {plan.served_step}, meta.json reads {reads['n']}; reading every step's meta.json instead: "
        f"{every * 1000:.0f} ms ({every / elapsed:.0f}x); load {os.getloadavg()[0]:.2f}"
    )
    if args.record:
        figures = {
            "steps": args.steps,
            "decision_ms": elapsed * 1000,
            "meta_reads": reads["n"],
            "every_ms": every * 1000,
        }
        results.record("repeat", figures, load_start)


if __name__ == "__main__":
    main()
