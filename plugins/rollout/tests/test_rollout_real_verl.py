"""The rollout roles on verl 0.9.1's own code: AgentLoopManager.generate_sequences (auto_await over
async), the trainer's gen-batch split and union, the built-in SkipManager, and the fully async
per-sample target under concurrency. Only the agent-loop workers (which would drive an LLM
server) are stand-ins, as small as verl's own code allows."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from omegaconf import OmegaConf
from skipinject import bootstrap
from skipinject.testing import RoleRun
from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncAgentLoopManager
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

PROMPT_LEN, RESPONSE_LEN, N = 6, 4, 2


class _Remote:
    def __init__(self, fn: Any, as_object_ref: bool) -> None:
        self.fn, self.as_object_ref = fn, as_object_ref

    def remote(self, chunk: DataProto) -> Any:
        result = self.fn(chunk)
        if self.as_object_ref:  # FullyAsyncAgentLoopManager awaits ``ref.future()``
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(result)
            return type("Ref", (), {"future": lambda self: future})()
        loop_future = asyncio.get_running_loop().create_future()
        loop_future.set_result(result)
        return loop_future


class StandInWorker:
    """Replies like an AgentLoopWorker: tokens derived from the prompt, per-sample metrics."""

    def __init__(self, calls: list[int], *, carry_uid: bool = False, as_object_ref: bool = False) -> None:
        self.calls, self.carry_uid = calls, carry_uid
        self.generate_sequences = _Remote(self._generate, as_object_ref)

    def _generate(self, chunk: DataProto) -> DataProto:
        self.calls.append(len(chunk))
        rows = len(chunk)
        seeds = [sum(map(ord, str(p))) for p in chunk.non_tensor_batch["raw_prompt"]]
        prompts = torch.tensor([[s % 97 + i for i in range(PROMPT_LEN)] for s in seeds])
        responses = torch.randint(0, 100, (rows, RESPONSE_LEN))
        batch = {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.ones(rows, PROMPT_LEN + RESPONSE_LEN, dtype=torch.int64),
            "response_mask": torch.ones(rows, RESPONSE_LEN, dtype=torch.int64),
            "rm_scores": torch.rand(rows, RESPONSE_LEN),
        }
        non_tensor = {"raw_prompt": chunk.non_tensor_batch["raw_prompt"].copy()}
        if self.carry_uid:
            non_tensor["uid"] = chunk.non_tensor_batch["uid"].copy()
        metrics = [{"generate_sequences": 1.5, "tool_calls": 0.0, "compute_score": 0.1, "num_preempted": 0}] * rows
        return DataProto.from_dict(tensors=batch, non_tensors=non_tensor, meta_info={"metrics": metrics})


def run_config(**skip: Any) -> Any:
    return OmegaConf.create(
        {
            "trainer": {
                "experiment_name": "exp",
                "project_name": "proj",
                "use_v1": False,
                "v1": {"trainer_mode": "sync"},
            },
            "data": {
                "train_batch_size": 4,
                "gen_batch_size": None,
                "max_prompt_length": PROMPT_LEN,
                "max_response_length": RESPONSE_LEN,
            },
            "actor_rollout_ref": {"rollout": {"n": N}},
            "skip": skip,
        }
    )


def manager(calls: list[int], cls: type = AgentLoopManager, **worker: Any) -> Any:
    mgr = object.__new__(cls)
    mgr.agent_loop_workers = [StandInWorker(calls, **worker), StandInWorker(calls, **worker)]
    mgr.config = run_config()
    return mgr


def trainer_batch(prompts: list[str], step: int) -> tuple[DataProto, DataProto]:
    """The V0 trainer's batch and the generation batch it hands to generate_sequences."""
    rows = len(prompts)
    batch = DataProto.from_dict(
        tensors={"dummy": torch.zeros(rows, 1)},
        non_tensors={
            "raw_prompt": np.fromiter(([{"role": "user", "content": p}] for p in prompts), dtype=object, count=rows),
            "data_source": np.array(["toy"] * rows, dtype=object),
            "reward_model": np.array([{"ground_truth": p} for p in prompts], dtype=object),
            "uid": np.array([f"u{step}-{i}-{np.random.rand()}" for i in range(rows)], dtype=object),
        },
    )
    gen_batch = RayPPOTrainer._get_gen_batch(None, batch)  # verl's own split
    gen_batch.meta_info["global_steps"] = step
    return batch, gen_batch.repeat(repeat_times=N, interleave=True)


def start(tmp_path: Path, role: str = "rollout", steps: tuple[int, ...] = (1,), **settings: Any) -> RoleRun:
    """A run of the installed ``role`` (what the runner starts for ``skip.<role>.*``)."""
    return RoleRun(role, tmp_path, steps, **settings).start()


PROMPTS = ["one two", "three four five", "six", "seven eight"]


def test_sync_caller_gets_a_dataproto_and_awaiting_caller_an_awaitable(tmp_path: Path):
    start(tmp_path, steps=(1,))
    calls: list[int] = []
    mgr = manager(calls)
    _, gen = trainer_batch(PROMPTS, 1)
    out = mgr.generate_sequences(gen)
    assert isinstance(out, DataProto) and len(out) == len(PROMPTS) * N
    bootstrap.stop()  # run 2 (a new engine) awaits the same step
    start(tmp_path, steps=(1,))

    async def awaiting() -> Any:
        pending = mgr.generate_sequences(gen)
        assert inspect.isawaitable(pending)
        return await pending

    again = asyncio.run(awaiting())
    assert isinstance(again, DataProto)
    assert calls == [4, 4], "run 1's call ran on both workers; run 2's awaiting call was served from its cache"
    assert torch.equal(again.batch["responses"], out.batch["responses"])


def test_miss_saves_hit_serves_and_union_accepts(tmp_path: Path, caplog):
    run = start(tmp_path, steps=(1, 2))
    calls: list[int] = []
    mgr = manager(calls, carry_uid=True)
    first = {}
    for step in (1, 2):
        batch, gen = trainer_batch(PROMPTS, step)
        out = mgr.generate_sequences(gen)
        assert out.meta_info["timing"]["skipinject/hit"] == 0.0
        first[step] = out
        batch.repeat(N, interleave=True).union(out)
    assert len(calls) == 4
    run.stop()  # the run ends: its last step is committed
    run.assert_miss(1)
    run.assert_miss(2)
    step_dir = tmp_path / "exp_proj" / f"GBS4_N{N}_in{PROMPT_LEN}_out{RESPONSE_LEN}" / "1"
    assert (step_dir / "meta.json").is_file() and not (step_dir / "gen_batch.dp").exists()

    run = start(tmp_path, steps=(1, 2))
    calls.clear()
    with caplog.at_level(logging.INFO, logger="skipinject"):
        for step in (1, 2):
            batch, gen = trainer_batch(PROMPTS, step)  # new uids, as in a new run
            out = mgr.generate_sequences(gen)
            for key in first[step].batch.keys():
                assert torch.equal(out.batch[key], first[step].batch[key]), key
            timing = out.meta_info["timing"]
            assert timing["skipinject/hit"] == 1.0 and "agent_loop/generate_sequences/mean" not in timing
            merged = batch.repeat(N, interleave=True).union(out)  # the trainer's next line must accept a hit
            assert len(merged) == len(PROMPTS) * N
    assert calls == []
    assert len(run.hits()) == 2
    run.assert_hit(1)
    run.assert_hit(2)


def test_other_prompts_are_reported_in_one_line_and_in_the_metrics(tmp_path: Path, caplog):
    start(tmp_path, steps=(1,))
    calls: list[int] = []
    mgr = manager(calls)
    mgr.generate_sequences(trainer_batch(PROMPTS, 1)[1])
    bootstrap.stop()
    start(tmp_path, steps=(1,))  # run 2 meets step 1 with other prompts
    shuffled = [PROMPTS[1], PROMPTS[0], PROMPTS[2], "a new prompt"]
    with caplog.at_level(logging.INFO, logger="skipinject"):
        out = mgr.generate_sequences(trainer_batch(shuffled, 1)[1])
    lines = [r.getMessage() for r in caplog.records if "other inputs" in r.getMessage()]
    assert len(lines) == 1 and "6 of 8 rows" in lines[0]
    assert out.meta_info["timing"]["skipinject/prompt_mismatch_rows"] == 6.0


def test_repeat_serves_the_nearest_step_and_says_which(tmp_path: Path, caplog):
    start(tmp_path, steps=(1, 2, 3), action="repeat")
    calls: list[int] = []
    mgr = manager(calls)
    mgr.generate_sequences(trainer_batch(PROMPTS, 1)[1])
    with caplog.at_level(logging.INFO, logger="skipinject"):
        out = mgr.generate_sequences(trainer_batch(PROMPTS, 3)[1])
    assert len(calls) == 2, "the first call missed (2 workers); step 3 is served from step 1"
    assert out.meta_info["timing"]["skipinject/served_step"] == 1.0
    assert any(
        "rollout step 3: hit, served step 1 (repeat: largest cached step below 3)" in r.getMessage()
        for r in caplog.records
    )


def test_validation_is_never_skipped(tmp_path: Path):
    start(tmp_path, steps=(0, 1))
    calls: list[int] = []
    mgr = manager(calls)
    for _ in range(2):
        _, gen = trainer_batch(PROMPTS, 1)
        gen.meta_info["validate"] = True
        mgr.generate_sequences(gen)
    assert len(calls) == 4
    assert not (tmp_path / "exp_proj").exists()


def test_builtin_skip_manager_is_turned_off_with_one_warning(tmp_path: Path, caplog):
    from verl.utils.skip.skip_manager import SkipManager

    start(tmp_path / "ours", steps=(1,))
    config = run_config(
        rollout={"enable": True, "steps": [1], "dump_dir": str(tmp_path / "builtin"), "action": "cache"}
    )
    calls: list[int] = []
    mgr = manager(calls)
    mgr.config = config
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        SkipManager.init(config)
        SkipManager.init(config)
        SkipManager.set_step(1)
        mgr.generate_sequences(trainer_batch(PROMPTS, 1)[1])
    bootstrap.stop()  # the run ends: its step is committed
    try:
        assert "rollout" not in SkipManager.skip_instances
        warnings = [r.getMessage() for r in caplog.records if "built-in skip.rollout" in r.getMessage()]
        assert len(warnings) == 1
        assert not (tmp_path / "builtin").exists(), "the built-in mechanism must not act"
        assert list((tmp_path / "ours").rglob("meta.json")), "skipinject acted"
    finally:
        SkipManager.skip_instances = {}


def test_rollout_role_warns_when_it_cannot_fire_in_v1(tmp_path: Path, caplog):
    from verl.utils.skip.skip_manager import SkipManager

    start(tmp_path, steps=(1,))
    config = run_config()
    config.trainer.use_v1 = True
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        SkipManager.init(config)
    assert any(
        "skip.rollout is enabled but cannot act" in r.getMessage() and "use_v1" in r.getMessage()
        for r in caplog.records
    )
    SkipManager.skip_instances = {}


def test_async_rollout_resolves_each_concurrent_sample_on_its_own(tmp_path: Path):
    start(tmp_path, role="async_rollout", steps=(2, 3, 5))
    calls: list[int] = []
    mgr = manager(calls, cls=FullyAsyncAgentLoopManager, as_object_ref=True)
    mgr.config = run_config()

    def sample(index: int, prefix: str) -> DataProto:
        prompt = np.fromiter([[{"role": "user", "content": f"prompt {index}"}]] * N, dtype=object, count=N)
        uid = np.array([f"{prefix}sample_0_{index}"] * N, dtype=object)
        return DataProto.from_dict(tensors={"dummy": torch.zeros(N, 1)}, non_tensors={"raw_prompt": prompt, "uid": uid})

    async def feed(prefix: str) -> list[DataProto]:
        return await asyncio.gather(*(mgr.generate_sequences_single(sample(i, prefix)) for i in range(1, 7)))

    first = asyncio.run(feed("uid_"))
    assert len(calls) == 6
    layout = tmp_path / "exp_proj" / f"GBS4_N{N}_in{PROMPT_LEN}_out{RESPONSE_LEN}"
    assert sorted(int(p.name) for p in layout.iterdir()) == [2, 3, 5]
    bootstrap.stop()
    start(tmp_path, role="async_rollout", steps=(2, 3, 5))
    calls.clear()
    second = asyncio.run(feed(""))  # the same feed indices without the ``uid_`` prefix
    assert len(calls) == 3, "feed indices 2, 3, 5 are served from the cache; 1, 4, 6 are generated"
    DataProto.concat(list(second))  # the fully async trainer's assembly: served and fresh samples agree
    for index in (2, 3, 5):
        assert torch.equal(second[index - 1].batch["responses"], first[index - 1].batch["responses"])
        assert second[index - 1].non_tensor_batch["raw_prompt"][0][0]["content"] == f"prompt {index}"


def test_match_generates_rows_a_v1_recording_cannot_carry_and_says_why(tmp_path: Path, caplog):
    """A V1 ``rollout_tq`` recording whose row keys are this call's (the same prompts and generation
    settings), met by a V0 run whose agent loop scores no row: a V0 row would carry the call's inputs, not
    the trajectory's reward, so a V0 ``match`` generates those rows, with one line naming the field (not
    the codecs' names)."""
    import json

    from skipinject.store import StepStore
    from skipinject.verl.codecs import TensorDictCodec
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    start(tmp_path, steps=(1,))
    calls: list[int] = []
    _, gen = trainer_batch(PROMPTS, 1)
    manager(calls).generate_sequences(gen)
    bootstrap.stop()
    layout = tmp_path / "exp_proj" / f"GBS4_N{N}_in{PROMPT_LEN}_out{RESPONSE_LEN}"
    meta = json.loads((layout / "1" / "meta.json").read_text())
    rows = len(PROMPTS) * N
    trajectories = list_of_dict_to_tensordict(
        [
            {"prompts": torch.arange(3 + i % 2), "responses": torch.arange(2 + i % 3), "uid": f"u{i // N}"}
            for i in range(rows)
        ]
    )
    keys = [f"u{i // N}_{i % N}_0" for i in range(rows)]
    v1 = {"tensordict": trajectories, "keys": keys, "tags": [{"status": "success"}] * rows, "global_steps": 1}
    store = StepStore(layout, "rollout", meta["context"])
    store.remove(1)
    v1_meta = {"role": "rollout_tq", "row_keys": meta["row_keys"], "rows_per_input": [1], "calls": 1}
    store.save(5, TensorDictCodec().encode(v1), v1_meta)

    start(tmp_path, steps=(1,), action="match")
    with caplog.at_level(logging.INFO, logger="skipinject"):
        out = manager(calls).generate_sequences(gen)
    assert calls == [4, 4, 4, 4], "every row generated again"
    assert len(out) == rows
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    [why] = [line for line in warned if "cached step 5" in line]
    assert "not served (CodecError: field 'rm_scores' cannot be carried exactly" in why, why
    assert "this run's agent loop scores no row" in why and "written by codec" not in why, why
