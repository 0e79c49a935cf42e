"""What skipinject adds to the start-up of every Python process of a run (CPU time, not wall time).

A run's configuration reaches each process through ``SKIPINJECT_CONFIG`` and a ``sitecustomize``;
this measures, per process, the CPU time over plain Python of: a process that never imports a
target package (most helper processes), a process that imports verl (where skipinject really
starts: plugins, hooks; the cache code waits for the first call that needs it), and the runner itself.
Each case runs as N interleaved pairs (plain, then with skipinject, so both see the same load): the
median of each side and the median of the pairs' differences, with the load average at start and end.

    python benchmarks/bench_startup.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

from benchmarks import results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_ms(argv: list[str], env: dict[str, str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return 1000 * ((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))


def paired_ms(base: tuple[list[str], dict[str, str]], ours: tuple[list[str], dict[str, str]], runs: int) -> list[float]:
    """Median CPU ms of ``base`` and ``ours`` and of their difference, over ``runs`` interleaved pairs."""
    cpu_ms(*base)  # warm the page cache and .pyc files
    cpu_ms(*ours)
    pairs = [(cpu_ms(*base), cpu_ms(*ours)) for _ in range(runs)]
    base_ms, ours_ms, added_ms = zip(*((b, o, o - b) for b, o in pairs), strict=True)
    return [statistics.median(base_ms), statistics.median(ours_ms), statistics.median(added_ms)]


def run_config() -> str:
    """The configuration the runner exports for ``skip.rollout.enable=True`` (printed by the runner)."""
    code = "import os; print(os.environ['SKIPINJECT_CONFIG'])"
    out = subprocess.run(
        [sys.executable, "-m", "skipinject", "-c", code, "skip.rollout.enable=True", "skip.rollout.steps=[1-3]"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    results.add_argument(parser)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    # Installed packages come with bytecode; a checkout run with PYTHONDONTWRITEBYTECODE would not.
    subprocess.run([sys.executable, "-m", "compileall", "-q", "skipinject", "plugins"], cwd=ROOT, check=True)
    plain = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    child = {
        **plain,
        "SKIPINJECT_CONFIG": run_config(),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [os.path.join(ROOT, "skipinject", "_bootstrap"), plain.get("PYTHONPATH")])
        ),
    }
    py = sys.executable
    cases = [
        ("process without a target package", [py, "-c", "pass"], plain, [py, "-c", "pass"], child),
        ("process importing verl", [py, "-c", "import verl"], plain, [py, "-c", "import verl"], child),
        (
            "process importing verl's agent loop (rollout target)",
            [py, "-c", "import verl.experimental.agent_loop.agent_loop"],
            plain,
            [py, "-c", "import verl.experimental.agent_loop.agent_loop"],
            child,
        ),
        (
            "the runner (`python -m skipinject -c pass`, rollout on)",
            [py, "-c", "pass"],
            plain,
            [py, "-m", "skipinject", "-c", "pass", "skip.rollout.enable=True"],
            plain,
        ),
    ]
    inside = []
    probe = (
        "import verl.experimental.agent_loop.agent_loop, gc, time; gc.disable(); t = time.thread_time(); "
        "from skipinject import bootstrap; bootstrap.start_from_env(); print(1000 * (time.thread_time() - t))"
    )
    for _ in range(args.runs):
        env = {k: v for k, v in child.items() if k != "PYTHONPATH"}
        out = subprocess.run([py, "-c", probe], env=env, capture_output=True, text=True, check=True)
        inside.append(float(out.stdout.strip().splitlines()[-1]))
    load_before = os.getloadavg()[0]
    rows = [
        (label, paired_ms((base_argv, base_env), (argv, env), args.runs))
        for label, base_argv, base_env, argv, env in cases
    ]
    print(
        f"CPU ms per process, median of {args.runs} interleaved pairs; "
        f"load {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end ({os.cpu_count()} cores)"
    )
    print("| process | plain Python | with skipinject | added (median of pairs) |")
    print("|---|---:|---:|---:|")
    processes = {}
    for label, (base, ours, added) in rows:
        processes[label] = {"plain_ms": base, "skipinject_ms": ours, "added_ms": added}
        print(f"| {label} | {base:.0f} | {ours:.0f} | {added:+.0f} |")
    print(
        f"| skipinject's own start and patching in a process that imported verl's agent loop "
        f"(its main thread's CPU, measured inside it; garbage collection paused: a full collection of verl's "
        f"heap that happens to land in the window is not skipinject's) | | | "
        f"+{statistics.median(inside):.0f} |"
    )
    if args.record:
        figures = {"runs": args.runs, "processes": processes, "inside_ms": statistics.median(inside)}
        results.record("startup", figures, load_start)


if __name__ == "__main__":
    main()
