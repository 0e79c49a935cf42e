"""A re-scored rollout hit costs the hit plus the reward, nothing more (``skip.rollout.rescore``).

One V0 rollout step (``--prompts`` x n=2 rows, ``--response`` tokens each) is recorded through verl
0.9.1's real ``AgentLoopManager.generate_sequences`` (the agent-loop workers that would drive an LLM
server reply with fixed tokens) under one reward function, then served again, ``--repeat`` times each:

* **served hit**: this run's reward is the recording's (``rescore=auto``: served as recorded);
* **re-scored hit**: another reward function (``rescore=auto``: every row scored again);
* **reward alone**: that reward on the same rows, as verl's reward-loop worker computes it
  (``compute_score_batch``), the batch handed to it already built.

The reward-loop worker is verl's own ``RewardLoopWorker`` in this process (its Ray actor handle is the
only stand-in: no Ray cluster), the same for the re-scored hit and the reward alone. Goal: re-scored
hit <= served hit + reward alone + 10 %. Each is timed in wall-clock and in this process's CPU time
(everything runs in it), the steadier figure on a shared machine.

    python benchmarks/bench_rescore.py [--prompts 128] [--response 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "verl_cpu"))

N = 2
PROMPT_LEN = 32
RECORDED_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 1.0\n"
THIS_RUN_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
    "    return float(len(solution_str.split()))\n"
)


class InProcessHandle:
    """``handle.compute_score_batch.remote(chunk)`` of a ``RewardLoopWorker`` living in this process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    @property
    def compute_score_batch(self) -> Any:
        worker = self.worker

        class Method:
            def remote(self, chunk: Any) -> Any:
                return worker.loop.run_until_complete(worker.compute_score_batch(chunk))

        return Method()


class Generator:
    """An agent-loop worker's reply with the reward loop on: fixed tokens, recorded scores and ``acc``."""

    def __init__(self, response: int) -> None:
        self.response = response
        outer = self

        class Method:
            def remote(self, chunk: Any) -> Any:
                future = asyncio.get_running_loop().create_future()
                future.set_result(outer.generate(chunk))
                return future

        self.generate_sequences = Method()

    def generate(self, chunk: Any) -> Any:
        from verl.protocol import DataProto

        rows, width = len(chunk), self.response
        prompts = torch.full((rows, PROMPT_LEN), 5, dtype=torch.int64)
        responses = torch.randint(20, 60, (rows, width), dtype=torch.int64)
        attention = torch.ones(rows, PROMPT_LEN + width, dtype=torch.int64)
        rm_scores = torch.zeros(rows, width)
        rm_scores[:, -1] = 1.0
        metrics = {"generate_sequences": 1.0, "tool_calls": 0.0, "compute_score": 0.1, "num_preempted": 0}
        return DataProto.from_dict(
            tensors={
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], dim=1),
                "attention_mask": attention,
                "position_ids": torch.arange(PROMPT_LEN + width).expand(rows, -1).clone(),
                "response_mask": torch.ones(rows, width, dtype=torch.int64),
                "rm_scores": rm_scores,
            },
            non_tensors={"__num_turns__": np.full(rows, 2, dtype=np.int32), "acc": np.ones(rows)},
            meta_info={"metrics": [metrics] * rows, "reward_extra_keys": ["acc"]},
        )


def config(model: Path, reward: Path, prompts: int, response: int) -> Any:
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    cfg.trainer.experiment_name, cfg.trainer.project_name, cfg.trainer.use_v1 = "bench", "rescore", False
    cfg.data.train_batch_size, cfg.data.gen_batch_size = prompts, None
    cfg.data.max_prompt_length, cfg.data.max_response_length = PROMPT_LEN, response
    cfg.actor_rollout_ref.rollout.n = N
    cfg.actor_rollout_ref.model.path = str(model)
    cfg.reward.custom_reward_function.path = str(reward)
    return cfg


def generation_batch(prompts: int) -> Any:
    from verl.protocol import DataProto

    texts = [f"prompt {i}" for i in range(prompts)]
    batch = DataProto.from_dict(
        tensors={"input_ids": torch.full((prompts, PROMPT_LEN), 5, dtype=torch.int64)},
        non_tensors={
            "raw_prompt": np.fromiter(([{"role": "user", "content": t}] for t in texts), dtype=object, count=prompts),
            "data_source": np.array(["toy"] * prompts, dtype=object),
            "reward_model": np.array([{"ground_truth": t} for t in texts], dtype=object),
        },
        meta_info={"global_steps": 1},
    )
    return batch.repeat(repeat_times=N, interleave=True)


def manager(cfg: Any, response: int) -> Any:
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    mgr = object.__new__(AgentLoopManager)
    mgr.agent_loop_workers = [Generator(response), Generator(response)]
    mgr.config = cfg
    mgr.reward_loop_worker_handles = [InProcessHandle(RewardLoopWorker(cfg))]
    return mgr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    results.add_argument(parser)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    logging.getLogger("skipinject").setLevel(logging.WARNING)
    import harness
    from skipinject_rollout import rescore

    from skipinject import Call, bootstrap
    from skipinject.testing import RoleRun

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = harness.build_assets(root / "assets")
        (root / "recorded.py").write_text(RECORDED_REWARD)
        (root / "this_run.py").write_text(THIS_RUN_REWARD)
        recorded = config(assets.model_dir, root / "recorded.py", args.prompts, args.response)
        this_run = config(assets.model_dir, root / "this_run.py", args.prompts, args.response)
        dump = root / "dump"
        RoleRun("rollout", dump, (1,)).start()
        manager(recorded, args.response).generate_sequences(generation_batch(args.prompts))
        bootstrap.stop()

        def hit(cfg: Any) -> tuple[tuple[float, float], Any]:
            mgr = manager(cfg, args.response)
            batch = generation_batch(args.prompts)
            RoleRun("rollout", dump, (1,), read_ahead=False).start()
            started = _clocks()
            out = mgr.generate_sequences(batch)
            elapsed = _since(started)
            bootstrap.stop()
            return elapsed, out

        served, rescored, alone = [], [], []
        for _ in range(args.repeat):
            seconds, out = hit(recorded)
            assert out.meta_info["timing"]["skipinject/rescored_rows"] == 0
            served.append(seconds)
            seconds, out = hit(this_run)
            assert out.meta_info["timing"]["skipinject/rescored_rows"] == len(out)
            rescored.append(seconds)
            mgr = manager(this_run, args.response)
            call = Call("bench", mgr.generate_sequences, mgr, (generation_batch(args.prompts),), {})
            scoring = rescore._scoring_batch(out, call, list(range(len(out))))
            started = _clocks()
            rescore._score_with_workers(mgr.reward_loop_worker_handles, scoring)
            alone.append(_since(started))
    rows = args.prompts * N
    print(f"rows {rows}, response {args.response} tokens, median of {args.repeat}; load average {_load()}")
    for clock, name in enumerate(("wall-clock", "CPU time")):
        med = [statistics.median(sample[clock] for sample in samples) for samples in (served, alone, rescored)]
        goal = (med[0] + med[1]) * 1.10
        overhead = med[2] - med[0] - med[1]
        print(
            f"{name:>10}: served hit {med[0] * 1000:.1f} ms, reward alone {med[1] * 1000:.1f} ms, re-scored hit "
            f"{med[2] * 1000:.1f} ms; goal (served + reward) x 1.10 = {goal * 1000:.1f} ms: "
            f"{'met' if med[2] <= goal else 'NOT met'} (overhead {overhead * 1000:.1f} ms)"
        )
    if args.record:
        medians = {
            clock: {
                name: statistics.median(sample[index] for sample in samples) * 1000
                for name, samples in (("served_ms", served), ("reward_ms", alone), ("rescored_ms", rescored))
            }
            for index, clock in enumerate(("wall", "cpu"))
        }
        figures = {"rows": rows, "response": args.response, "repeat": args.repeat, **medians}
        results.record("rescore", figures, load_start)


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(started: tuple[float, float]) -> tuple[float, float]:
    now = _clocks()
    return now[0] - started[0], now[1] - started[1]


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
