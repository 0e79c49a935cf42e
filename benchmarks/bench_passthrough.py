"""The cost of a patched call at a step that is not chosen, against verl's own ``SkipManager.annotate``.

Every generation call of every run pays this path, so it must cost no more than upstream's. Both
sides wrap the same trivial method (a sync ``def`` and an ``async def``) whose batch carries
``meta_info["global_steps"] = 5`` while only step 1000 is chosen; upstream's wrapper runs with an
enabled skip instance (its validation check, instance look-up and step test), skipinject's through
the real injector and engine (role ``rollout``-like: step from ``meta_info``). Printed: ns per call
(best of 7 rounds), the overhead over the bare method, and the ratio, with the load average.

    python benchmarks/bench_passthrough.py [--calls N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks import results as results_file


class Batch:
    def __init__(self, step: int) -> None:
        self.meta_info = {"global_steps": step}
        self.non_tensor_batch: dict[str, Any] = {}


class Manager:
    def generate(self, prompts: Batch) -> int:
        return 1

    async def agenerate(self, prompts: Batch) -> int:
        return 1


def _time(fn: Any, calls: int, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter_ns()
        fn(calls)
        best = min(best, (time.perf_counter_ns() - started) / calls)
    return best


def _sync_loop(method: Any, batch: Batch) -> Any:
    def loop(calls: int) -> None:
        for _ in range(calls):
            method(batch)

    return loop


def _async_loop(method: Any, batch: Batch) -> Any:
    async def body(calls: int) -> None:
        for _ in range(calls):
            await method(batch)

    return lambda calls: asyncio.run(body(calls))


def measure(calls: int) -> dict[str, float]:
    from verl.utils.skip.skip_manager import SkipManager

    batch = Batch(5)
    bare = Manager()
    results = {"bare sync": _time(_sync_loop(bare.generate, batch), calls)}
    results["bare async"] = _time(_async_loop(bare.agenerate, batch), calls)

    class Instance:  # an enabled built-in skip instance, as SkipManager.init leaves it
        support_online_step = False
        steps = [1000]

        def is_enabled(self) -> bool:
            return True

    SkipManager.skip_instances = {"rollout": Instance()}
    SkipManager.step = 5

    class Upstream(Manager):
        generate = SkipManager.annotate("rollout")(Manager.generate)
        agenerate = SkipManager.annotate("rollout")(Manager.agenerate)

    upstream = Upstream()
    results["upstream sync"] = _time(_sync_loop(upstream.generate, batch), calls)
    results["upstream async"] = _time(_async_loop(upstream.agenerate, batch), calls)

    from skipinject import Role, StepSource, Target
    from skipinject.config import Config, RoleConfig
    from skipinject.engine import Engine

    module = sys.modules[__name__]
    module.Ours = type("Ours", (Manager,), {})  # type: ignore[attr-defined]
    role = Role(
        name="bench",
        targets=[Target(f"{__name__}:Ours.generate"), Target(f"{__name__}:Ours.agenerate")],
        step=StepSource.meta("global_steps"),
    )
    with tempfile.TemporaryDirectory() as dump:
        settings = RoleConfig(enable=True, steps=(1000,), dump_dir=dump)
        engine = Engine(Config(roles={"bench": settings}), {"bench": (role, "bench")})
        engine.start()
        try:
            ours = module.Ours()
            results["skipinject sync"] = _time(_sync_loop(ours.generate, batch), calls)
            results["skipinject async"] = _time(_async_loop(ours.agenerate, batch), calls)
        finally:
            engine.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    results_file.add_argument(parser)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    results = measure(args.calls)
    print(f"pass-through of a step not chosen, ns per call (best of 7 x {args.calls}); load {os.getloadavg()[0]:.2f}")
    print(
        "| convention | bare | upstream annotate | skipinject | upstream overhead | skipinject overhead"
        " | ratio (upstream/skipinject overhead) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in ("sync", "async"):
        bare, up, ours = results[f"bare {kind}"], results[f"upstream {kind}"], results[f"skipinject {kind}"]
        ratio = (up - bare) / max(ours - bare, 1e-9)
        print(f"| {kind} | {bare:.0f} | {up:.0f} | {ours:.0f} | {up - bare:.0f} | {ours - bare:.0f} | {ratio:.2f}x |")
    if args.record:
        results_file.record("passthrough", {"calls": args.calls, "ns_per_call": results}, load_start)


if __name__ == "__main__":
    main()
