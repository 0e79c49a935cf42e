"""A recording of one verl trainer served to the other by ``action=match``, on verl 0.9.1's own code.

Both trainers' rows are made by verl's own agent-loop workers from one LLM output: the V0 worker's
``AgentLoopWorker.generate_sequences`` (padded rows, behind the real ``AgentLoopManager.generate_sequences``)
and the V1 worker's ``AgentLoopWorkerTQ.generate_sequences`` (trajectories put into a real TransferQueue,
behind verl's real V1 trainer methods and ``ReplayBuffer``). Only the agent loop is a stand-in (what
``_run_agent_loop`` instantiates, which would ask an LLM server): its output is fixed by the prompt's text and
the session, and verl's post-processing runs on it. So what the other trainer would have made of a served
row is known, and the served rows are checked against it field by field, bit for bit.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import transfer_queue as tq
from omegaconf import OmegaConf
from plugins.rollout.tests.test_rescore import run_config as verl_config
from plugins.rollout.tests.test_rollout_real_verl import trainer_batch
from plugins.rollout_tq.tests.test_rollout_tq import Session, clean_tq, messages_of, transfer_queue
from skipinject import bootstrap
from skipinject.clock import CLOCK
from skipinject.testing import RoleRun
from skipinject_rollout_tq.plugin import ROLLOUT_TQ
from tensordict import NonTensorData
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker
from verl.protocol import DataProto
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import get_trainer_cls
from verl.utils import hf_tokenizer
from verl.utils.tensordict_utils import index_select_tensor_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "verl_cpu"))
import harness

__all__ = ["clean_tq", "transfer_queue"]  # the real TransferQueue fixtures, shared with the rollout_tq tests

PROMPT_LEN, RESPONSE_LEN, N, BATCH = 8, 6, 2, 4
PROMPTS = [f"question {i}" for i in range(8)]
SENTINEL = object()  # a reward loop worker handle: the agent loop scores its rows (verl's default)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return harness.build_assets(tmp_path_factory.mktemp("assets"))


def config(assets: Any, v1: bool, log_probs: bool = False) -> Any:
    """verl's own default config for either trainer: the generation settings are the same, so are the keys."""
    conf = verl_config(assets, None)
    conf.data.max_prompt_length, conf.data.max_response_length = PROMPT_LEN, RESPONSE_LEN
    conf.actor_rollout_ref.rollout.calculate_log_probs = log_probs
    conf.actor_rollout_ref.rollout.val_kwargs.n = N  # the V1 answer key below is put aside as validation samples
    conf.trainer.use_v1 = v1
    OmegaConf.update(conf, "trainer.v1", {"trainer_mode": "sync", "sync": {"parameter_sync_step": 1}}, merge=True)
    OmegaConf.update(conf, "algorithm.filter_groups", {"enable": False}, merge=True)
    return conf


class LLM:
    """The one stand-in: an ``AgentLoopOutput`` fixed by the prompt's text and the session."""

    def __init__(self, tokenizer: Any, log_probs: bool) -> None:
        self.pad = int(tokenizer.pad_token_id)
        self.log_probs = log_probs
        self.asked: list[str] = []

    def output(self, raw_prompt: Any, session: int) -> AgentLoopOutput:
        text = raw_prompt[0]["content"]
        self.asked.append(text)
        seed = sum(map(ord, text))
        prompt = [(seed + i) % 50 + 3 for i in range(2 + seed % 5)]
        length = 1 + (seed + session) % RESPONSE_LEN
        response = [(seed * 3 + session + i) % 50 + 3 for i in range(length)]
        if length > 2:
            response[1] = self.pad  # a pad token inside the response: unpadding goes by the mask
        mask = [0 if i == 2 and length > 3 else 1 for i in range(length)]  # a tool token
        return AgentLoopOutput(
            prompt_ids=prompt,
            response_ids=response,
            response_mask=mask,
            response_logprobs=[-(i + 1) / 7 - session / 3 for i in range(length)] if self.log_probs else None,
            reward_score=(seed % 7 + session) / 3,
            num_turns=2,
            metrics=AgentLoopMetrics(generate_sequences=0.25, compute_score=0.5, num_preempted=0),
            extra_fields={"turn_scores": [], "tool_rewards": [], "reward_extra_info": {"acc": seed % 3 / 2}},
        )


def workers(conf: Any, llm_log_probs: bool) -> tuple[Any, Any, LLM]:
    """verl's V0 and V1 agent-loop workers, as built for a run but for their LLM servers: each runs the
    stand-in LLM where ``_run_agent_loop`` would instantiate the agent loop, then verl's post-processing."""
    tokenizer = hf_tokenizer(str(conf.actor_rollout_ref.model.path))
    llm = LLM(tokenizer, llm_log_probs)
    made = []
    for cls in (AgentLoopWorker, AgentLoopWorkerTQ.__ray_metadata__.modified_class):
        worker = object.__new__(cls)
        worker.config, worker.rollout_config = conf, conf.actor_rollout_ref.rollout
        worker.tokenizer, worker.processor = tokenizer, None
        worker.reward_loop_worker_handles = [SENTINEL]
        worker.distillation_enabled = False
        worker.mm_processor_kwargs = conf.data.get("mm_processor_kwargs", {})
        worker.background_tasks = set()
        worker._run_agent_loop = agent_loop(worker, llm)
        made.append(worker)
    return made[0], made[1], llm


def agent_loop(worker: Any, llm: LLM) -> Any:
    """``AgentLoopWorker._run_agent_loop`` with the LLM's output for the agent loop's (the session: the V1
    worker's ``session_id``, the V0 worker's ``rollout_n`` of the trajectory)."""

    async def run(sampling_params: Any, trajectory: Any, *, agent_name: str, trace: bool = True, **kwargs: Any) -> Any:
        output = llm.output(kwargs["raw_prompt"], kwargs.get("session_id", trajectory["rollout_n"]))
        return await worker._agent_loop_postprocess(output, trajectory["validate"], **kwargs)

    return run


# ---------------------------------------------------------------- the V0 trainer's side


class V0Worker:
    """An agent loop worker actor: ``generate_sequences.remote`` runs verl's ``AgentLoopWorker.generate_sequences``."""

    def __init__(self, worker: Any) -> None:
        self.worker, self.calls = worker, []
        outer = self

        class Method:
            def remote(self, chunk: DataProto) -> Any:
                outer.calls.append(len(chunk))
                return outer.worker.generate_sequences(chunk)

        self.generate_sequences = Method()


def v0_manager(conf: Any, worker: V0Worker) -> Any:
    manager = object.__new__(AgentLoopManager)
    manager.config, manager.agent_loop_workers = conf, [worker]
    manager.reward_loop_worker_handles = [SENTINEL]
    return manager


def v0_gen_batch(prompts: list[str], step: int) -> DataProto:
    """What the V0 trainer hands the agent loop manager: its gen batch (with the dataset's ``index``), repeated
    ``n`` times, interleaved."""
    _, gen = trainer_batch(prompts, step)
    gen.non_tensor_batch["index"] = np.repeat(np.arange(len(prompts)), N)
    return gen


# ---------------------------------------------------------------- the V1 trainer's side


class V1Manager:
    """``AgentLoopManagerTQ.generate_sequences`` with its one worker in this process: verl's
    ``AgentLoopWorkerTQ.generate_sequences`` spawns each prompt's sessions into TransferQueue; awaited here."""

    def __init__(self, worker: Any) -> None:
        self.worker, self.calls = worker, []

    def generate_sequences(self, batch: Any) -> None:
        self.calls.append([p[0]["content"] for p in batch["raw_prompt"]])
        asyncio.run(self.generate(batch))

    async def generate(self, batch: Any) -> None:
        await self.worker.generate_sequences(batch)
        await asyncio.gather(*self.worker.background_tasks)


def v1_trainer(conf: Any, manager: V1Manager, prompts: list[str]) -> Any:
    """verl's real V1 trainer class with the state its submit path reads; its dataloader yields ``prompts``."""
    trainer = object.__new__(get_trainer_cls("sync"))
    trainer.config, trainer.trainer_mode, trainer.parameter_sync_step = conf, "sync", 1
    trainer.train_dataloader = [
        {
            "raw_prompt": np.fromiter(
                ([{"role": "user", "content": p}] for p in prompts[start : start + BATCH]), dtype=object, count=BATCH
            ),
            "data_source": np.array(["toy"] * BATCH, dtype=object),
            "reward_model": np.array([{"ground_truth": p} for p in prompts[start : start + BATCH]], dtype=object),
            "index": np.arange(start, start + BATCH),
        }
        for start in range(0, len(prompts), BATCH)
    ]
    trainer.train_dataloader_it, trainer.global_steps = None, 0
    trainer.agent_loop_manager = manager
    trainer.replay_buffer = ReplayBuffer(
        trainer_mode="sync",
        trainer_config=conf.trainer.v1.sync,
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        poll_interval=0.05,
        refill_fn=trainer._add_prompts_to_generate,
        filter_groups_metric=None,
        train_batch_size=BATCH,
        gen_batch_size=BATCH,
    )
    drawn: list[Any] = []
    draw = trainer._next_train_batch
    trainer._next_train_batch = lambda *args: drawn.append(draw(*args)) or drawn[-1]
    trainer.drawn = drawn
    CLOCK.enter(trainer)
    return trainer


def v1_step(trainer: Any, step: int) -> tuple[list[str], Any]:
    """Submit and sample a step as ``PPOTrainer`` does; the trained keys and all their fields, then cleared."""
    trainer.global_steps = step
    trainer._add_batch_to_generate()
    batch, _ = trainer.replay_buffer.sample(global_steps=step, partition_id="train", batch_size=BATCH)
    data = tq.kv_batch_get(keys=batch.keys, partition_id="train")
    tq.kv_clear(keys=batch.keys, partition_id="train")
    return list(batch.keys), data


def rows_of(data: Any, keys: list[str]) -> dict[str, dict[str, Any]]:
    """Per key, each field's value in that row (tensors unbound from their jagged or dense stack)."""
    out: dict[str, dict[str, Any]] = {key: {} for key in keys}
    for name in data.keys():
        value = data[name]
        if isinstance(value, torch.Tensor):
            values = list(value.unbind(0))
        else:  # a NonTensorStack, or the list a TransferQueue backend gives back
            values = list(value.tolist()) if hasattr(value, "tolist") else list(value)
        for key, item in zip(keys, values, strict=True):
            out[key][name] = item
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b and type(a) is type(b)


def layout(tmp_path: Path) -> Path:
    return tmp_path / "exp_proj" / f"GBS{BATCH}_N{N}_in{PROMPT_LEN}_out{RESPONSE_LEN}"


# ---------------------------------------------------------------- V0 recording -> V1 match


@pytest.mark.ray
def test_a_v0_recording_serves_a_v1_match_as_the_v1_agent_loop_writes_it(
    tmp_path: Path, assets: Any, clean_tq: None, caplog
):
    v0_conf, v1_conf = config(assets, v1=False, log_probs=True), config(assets, v1=True, log_probs=True)
    v0_worker, v1_worker, llm = workers(v0_conf, llm_log_probs=True)
    run = RoleRun("rollout", tmp_path, (1,)).start()  # the V0 run records prompts 0-3 (action=cache)
    v0_manager(v0_conf, V0Worker(v0_worker)).generate_sequences(v0_gen_batch(PROMPTS[:4], 1))
    run.stop()
    assert json.loads((layout(tmp_path) / "1" / "meta.json").read_text())["role"] == "rollout"

    llm.asked.clear()
    manager = V1Manager(v1_worker)
    with Session(tmp_path, steps=(1,), action="match"), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = v1_trainer(v1_conf, manager, [PROMPTS[1], PROMPTS[4], PROMPTS[3], PROMPTS[5]])
        keys, data = v1_step(trainer, 1)
    assert manager.calls == [[PROMPTS[4], PROMPTS[5]]], "only the prompts the V0 run never saw are generated"
    # The V0 run's step 1 is not overwritten: the V1 run's new trajectories are a rows record beside it.
    assert json.loads((layout(tmp_path) / "1" / "meta.json").read_text())["role"] == "rollout"
    assert json.loads((layout(tmp_path) / "rows" / "1" / "meta.json").read_text())["role"] == "rollout_tq"
    [line] = messages_of(caplog, "rollout_tq step 1: match (submit)")
    assert "2 of 4 prompts served (4 trajectories from step 1 (4))" in line and line.endswith(
        "2 submitted for generation"
    )

    # What verl's V1 agent loop writes for the served prompts (same prompt fields, same LLM output), put aside.
    [batch] = trainer.drawn
    served = {str(batch["uid"][i]) for i in (0, 2)}
    aside = index_select_tensor_dict(batch, [0, 2])
    aside["validate"] = NonTensorData(True)  # verl's worker puts a validation batch into the "val" partition
    asyncio.run(manager.generate(aside))
    truth_keys = [f"{uid}_{session}_0" for uid in sorted(served) for session in range(N)]
    truth = rows_of(tq.kv_batch_get(keys=truth_keys, partition_id="val"), truth_keys)
    trained = rows_of(data, keys)
    assert len(trained) == BATCH * N and {key.split("_")[0] for key in keys} >= served
    for key in truth_keys:
        got, want = trained[key], truth[key]
        assert set(got) == set(want), key  # the same fields, as the trainer and the replay buffer read them
        for name in want:
            if name == "metrics":  # the agent loop's timings: V0 keeps none per row, the trainer reads none
                assert got[name] == {
                    "generate_sequences": 0.0,
                    "tool_calls": 0.0,
                    "compute_score": 0.0,
                    "num_preempted": -1,
                }
                continue
            assert same(got[name], want[name]), (key, name, got[name], want[name])
    clear_val(truth_keys, served)


def clear_val(keys: list[str], uids: set[str]) -> None:
    tq.kv_clear(keys=[*keys, *sorted(uids)], partition_id="val")


# ---------------------------------------------------------------- V1 recording -> V0 match


@pytest.mark.ray
def test_a_v1_recording_serves_a_v0_match_as_the_v0_agent_loop_pads_it(
    tmp_path: Path, assets: Any, clean_tq: None, caplog
):
    v0_conf, v1_conf = config(assets, v1=False), config(assets, v1=True)
    v0_worker, v1_worker, llm = workers(v0_conf, llm_log_probs=False)
    manager = V1Manager(v1_worker)
    with Session(tmp_path, steps=(1,)):  # the V1 run records prompts 0-3 (action=cache)
        v1_step(v1_trainer(v1_conf, manager, PROMPTS[:4]), 1)
    assert json.loads((layout(tmp_path) / "1" / "meta.json").read_text())["role"] == "rollout_tq"

    worker = V0Worker(v0_worker)
    gen = v0_gen_batch([PROMPTS[2], PROMPTS[6], PROMPTS[0], PROMPTS[7]], 1)
    truth = asyncio.run(v0_worker.generate_sequences(copy.deepcopy(gen)))  # verl's V0 agent loop on the whole call
    worker.calls.clear()
    llm.asked.clear()
    run = RoleRun("rollout", tmp_path, (1,), action="match").start()
    with caplog.at_level(logging.INFO, logger="skipinject"):
        out = v0_manager(v0_conf, worker).generate_sequences(gen)
    run.stop()
    assert worker.calls == [4] and sorted(set(llm.asked)) == [PROMPTS[6], PROMPTS[7]], "only the new prompts"
    [line] = [m for m in messages_of(caplog, "rollout step 1: match:")]
    assert "4 of 8 rows served from step 1 (4)" in line and "4 generated in one call of 4 rows" in line
    # The V1 run's step 1 is not overwritten: the V0 run's new rows are a rows record beside it.
    assert json.loads((layout(tmp_path) / "1" / "meta.json").read_text())["role"] == "rollout_tq"
    assert json.loads((layout(tmp_path) / "rows" / "1" / "meta.json").read_text())["role"] == "rollout"
    assert set(out.batch.keys()) == set(truth.batch.keys())
    for name in truth.batch.keys():
        assert out.batch[name].dtype == truth.batch[name].dtype and torch.equal(out.batch[name], truth.batch[name]), (
            name
        )
    assert set(out.non_tensor_batch) == set(truth.non_tensor_batch)
    for name, column in truth.non_tensor_batch.items():
        assert out.non_tensor_batch[name].dtype == column.dtype, name
        assert out.non_tensor_batch[name].tolist() == column.tolist(), name
    assert out.meta_info["reward_extra_keys"] == truth.meta_info["reward_extra_keys"]


# ---------------------------------------------------------------- a field that cannot be carried


@pytest.mark.ray
def test_a_field_the_recording_cannot_carry_is_generated_and_one_line_names_it(
    tmp_path: Path, assets: Any, clean_tq: None, caplog
):
    """The V1 run computes rollout log probs; the V0 recording has none: its prompts are generated, and
    one line names the field and why (log probs are never made up)."""
    v0_conf, v1_conf = config(assets, v1=False), config(assets, v1=True, log_probs=True)
    v0_worker, v1_worker, llm = workers(v0_conf, llm_log_probs=False)
    run = RoleRun("rollout", tmp_path, (1,)).start()
    v0_manager(v0_conf, V0Worker(v0_worker)).generate_sequences(v0_gen_batch(PROMPTS[:4], 1))
    run.stop()

    llm.log_probs = True
    manager = V1Manager(v1_worker)
    with Session(tmp_path, steps=(2, 3), action="match"), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = v1_trainer(v1_conf, manager, PROMPTS[:4] + PROMPTS[:4])
        v1_step(trainer, 2)
        v1_step(trainer, 3)
    assert len(manager.calls) == 1 and manager.calls[0] == PROMPTS[:4], "step 2 generated; step 3 served from it"
    lines = [m for m in messages_of(caplog, "not served", logging.WARNING) if "step 1 of" in m]
    assert len(lines) == 1, lines
    assert "field 'rollout_log_probs' cannot be carried exactly" in lines[0]
    assert "this run computes them in the rollout and the V0 recording has none" in lines[0]


@pytest.fixture(autouse=True)
def _stopped() -> Iterator[None]:
    yield
    bootstrap.stop()


def test_the_roles_read_each_others_recordings():
    from skipinject_rollout.rollout import ROLLOUT

    assert tuple(ROLLOUT.match_reads) == ("rollout_tq",) and tuple(ROLLOUT_TQ.match_reads) == ("rollout",)
