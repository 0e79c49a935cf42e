"""The ``rollout_tq`` role against a real TransferQueue (Ray actors), verl 0.9.1's real V1 trainer
methods (``_add_batch_to_generate``, ``_next_train_batch``, ``_submit_batch_to_rollout``,
``_add_async_warmup_batches``) and its real ``ReplayBuffer`` / ``ReplayBufferAsync``.

Only the agent-loop manager is a stand-in: it writes trajectories into TransferQueue the way
``AgentLoopWorkerTQ`` does (same keys, tags, fields, prompt status), synchronously.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import transfer_queue as tq
from omegaconf import OmegaConf
from skipinject.clock import CLOCK
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine
from skipinject.engine.background import WRITER
from skipinject.report.tally import TALLY
from skipinject.store import StepStore, StepWriter
from skipinject.verl.codecs import TensorDictCodec
from skipinject.verl.compat import installed_verl_matches
from skipinject_rollout_tq.phases import parameter_sync_step
from skipinject_rollout_tq.plugin import cannot_fire, make_role
from skipinject_rollout_tq.transfer import CachedBatch, group_rows, inject, prepare, remap, select_rows
from tensordict import TensorDict
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_base import get_trainer_cls
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

N = 2
BATCH = 4
LAYOUT = f"e_p/GBS{{gbs}}_N{N}_in8_out8"


# ---------------------------------------------------------------- pure remapping rules


def _keys(groups: dict[str, int]) -> list[str]:
    return [f"{uid}_{session}_0" for uid, count in groups.items() for session in range(count)]


def test_remap_cycles_groups_and_sessions_and_rewrites_tags():
    keys = _keys({"a": 2, "b": 1, "c": 2})  # b lost a session (failed agent loop)
    tags = [
        {"status": "success", "global_steps": 7, "min_global_steps": 6, "max_global_steps": 7, "row": i}
        for i in range(5)
    ]
    tags[0]["is_prompt"] = True
    plan = remap(keys, tags, ["n0", "n1", "n2", "n3"], N, step=3)
    assert plan.groups == 3
    assert plan.keys == [f"n{i}_{s}_0" for i in range(4) for s in range(N)]
    # uid i takes group i % 3; session j takes trajectory j % len(group)
    assert plan.rows == [0, 1, 2, 2, 3, 4, 0, 1]
    assert plan.uids == ["n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3"]
    assert plan.sessions == [0, 1] * 4
    for tag, row in zip(plan.tags, plan.rows, strict=True):
        assert tag == {"status": "success", "global_steps": 3, "min_global_steps": 3, "max_global_steps": 3, "row": row}
    assert tags[0]["is_prompt"] is True, "the cached tags are not modified"


def test_remap_uses_the_first_groups_when_more_were_cached():
    keys = _keys({"a": 2, "b": 2, "c": 2, "d": 2, "e": 2})
    plan = remap(keys, [{} for _ in keys], ["x", "y"], N, step=1)
    assert plan.rows == [0, 1, 2, 3] and plan.groups == 5


def test_groups_do_not_depend_on_key_order():
    keys = ["b_1_0", "a_0_0", "b_0_0", "a_1_0"]
    assert group_rows(keys) == [[0, 2], [1, 3]]
    plan = remap(keys, [{} for _ in keys], ["x", "y"], N, step=1)
    assert plan.rows == [0, 2, 1, 3]


def test_cannot_fire_on_the_v0_trainer():
    assert "skip.rollout" in cannot_fire(OmegaConf.create({"trainer": {"use_v1": False}}))
    assert cannot_fire(OmegaConf.create({"trainer": {"use_v1": True}})) is None


def test_a_verl_without_the_v1_trainer_is_said_and_points_to_skip_rollout(monkeypatch: pytest.MonkeyPatch):
    """verl's neo line has no TransferQueue glue and no V1 trainer: whatever the config, one reason."""
    import sys

    from skipinject_rollout_tq import plugin

    assert plugin.no_v1_trainer() is None, "verl 0.9.1 has its V1 trainer"
    # the neo tree: verl's package without the TransferQueue glue's file (looked for, never imported)
    monkeypatch.setattr(plugin, "V1_GLUE", "verl.utils.transferqueue_utils_absent")
    assert "transferqueue_utils_absent" not in sys.modules
    for use_v1 in (True, False):
        reason = cannot_fire(OmegaConf.create({"trainer": {"use_v1": use_v1}}))
        assert reason is not None and "has no V1 TransferQueue trainer" in reason and "use skip.rollout" in reason


def test_installed_plugin_provides_the_role_through_its_entry_point():
    from skipinject.plugin_manager import load_plugins
    from tests.unit.test_verl_versions import MANAGER_METHODS

    plugins = load_plugins("rollout_tq")
    [plugin] = plugins.plugins
    assert plugin.distribution == "skipinject"  # built in: shipped in the core wheel, found like any plugin
    role = plugins.roles["rollout_tq"]
    paths = {target.path: target.every_step for target in role.targets}
    assert paths == {
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._add_batch_to_generate": False,
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._add_prompts_to_generate": False,
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample": True,  # and ReplayBufferAsync's override
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._add_async_warmup_batches": True,
        # verl 0.9.0's warm-up, in its async modes' on_train_begin
        "verl.trainer.ppo.v1.trainer_colocate_async:PPOTrainerColocateAsync.on_train_begin": True,
        "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync.on_train_begin": True,
        # a deferred weight sync is carried out before the engine generates
        "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopManagerTQ.generate_sequences": True,
        **{f"verl.checkpoint_engine.base:CheckpointEngineManager.{method}": True for method in MANAGER_METHODS},
    }
    overrides = {target.path.rpartition(".")[2]: target.overrides for target in role.targets if target.overrides}
    assert set(overrides) == {"_add_batch_to_generate", "sample"}
    assert role.builtin == "rollout_tq" and role.cache_subdir == "" and role.upstream.file_name == "0/tq_batch.pt"


# ---------------------------------------------------------------- real TransferQueue


@pytest.fixture(scope="module")
def transfer_queue() -> Iterator[None]:
    """A real TransferQueue (controller + one SimpleStorage unit) on a local Ray, as main_ppo starts it."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="skipinject-tests")
    conf = OmegaConf.create(
        {"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": 1}}}
    )
    tq.init(conf)
    try:
        yield
    finally:
        tq.close()
        ray.shutdown()


@pytest.fixture
def clean_tq(transfer_queue: None) -> Iterator[None]:
    yield
    clear_tq()


def clear_tq() -> None:
    """Empty every TransferQueue partition (a finished or dead run's data is gone)."""
    for partition, items in (tq.kv_list() or {}).items():
        if items:
            tq.kv_clear(keys=list(items), partition_id=partition)


def trajectory(uid: str, session: int, step: int, seed: int, uniform: bool = False) -> dict[str, Any]:
    """One trajectory's fields, shaped like AgentLoopWorkerTQ's (jagged prompt/response lengths).

    ``uniform``: every session of the prompt gets reward 0 (a group DAPO's filter evicts).
    """
    prompt_len, response_len = 3 + seed % 4, 1 + (seed * 7 + session) % 6
    prompts = torch.arange(prompt_len, dtype=torch.int64) + seed
    responses = torch.arange(response_len, dtype=torch.int64) * (session + 2) + seed
    reward = 0.0 if uniform else float(seed + session + 1) / 10
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses]),
        "response_mask": torch.ones(response_len, dtype=torch.int64),
        "rm_scores": torch.cat([torch.zeros(response_len - 1), torch.tensor([reward])]),
        "uid": uid,
        "session_id": session,
        "global_steps": step,
        "raw_prompt": [{"role": "user", "content": f"prompt {seed}"}],
        "data_source": "toy",  # the prompt's inputs a reward reads, as verl's trajectories carry them
        "reward_model": {"ground_truth": str(seed)},
        "extra_fields": {"min_global_steps": step - 1, "reward_extra_info": {"acc": seed / 10}},
    }


def put_trajectories(
    uid: str, step: int, seed: int, sessions: range, partition: str = "train", uniform: bool = False
) -> list[str]:
    fields = [trajectory(uid, session, step, seed, uniform) for session in sessions]
    keys = [f"{uid}_{session}_0" for session in sessions]
    tags = [
        {
            "status": "success",
            "prompt_len": len(f["prompts"]),
            "response_len": len(f["responses"]),
            "global_steps": step,
            "min_global_steps": step - 1,
            "max_global_steps": step - 1,
        }
        for f in fields
    ]
    tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id=partition)
    return keys


class StandInAgentLoopManager:
    """Generates n trajectories per submitted prompt straight into TransferQueue, then marks it finished.

    Prompts whose dataset index is in ``uniform`` get the same reward in every session (DAPO's
    filter evicts them); those in ``short`` get one trajectory only (the other sessions failed).
    """

    def __init__(self, uniform: frozenset[int] = frozenset(), short: frozenset[int] = frozenset()) -> None:
        self.calls: list[list[str]] = []
        self.indices: list[list[int]] = []
        self.uniform = uniform
        self.short = short

    def generate_sequences(self, batch: TensorDict) -> None:
        uids = [str(u) for u in batch["uid"]]
        self.calls.append(uids)
        indices = [int(i) for i in batch["index"]]
        self.indices.append(indices)
        step = int(batch["global_steps"])
        for uid, index in zip(uids, indices, strict=True):
            tq.kv_put(key=uid, partition_id="train", tag={"status": "running"})
            sessions = range(1 if index in self.short else N)
            put_trajectories(uid, step, seed=index, sessions=sessions, uniform=index in self.uniform)
            tq.kv_put(key=uid, partition_id="train", tag={"status": "finished"})


def run_config(mode: str = "sync", k: int = 1, dapo: bool = False) -> Any:
    return OmegaConf.create(
        {
            "trainer": {
                "use_v1": True,
                "experiment_name": "e",
                "project_name": "p",
                "v1": {"trainer_mode": mode, mode: {"parameter_sync_step": k}},
            },
            "algorithm": {"filter_groups": {"enable": dapo, "metric": "reward"}},
            "data": {
                "train_batch_size": BATCH,
                "gen_batch_size": 1 if mode != "sync" or dapo else None,
                "max_prompt_length": 8,
                "max_response_length": 8,
            },
            "actor_rollout_ref": {"rollout": {"n": N}},
            "skip": {"rollout_tq": {"enable": False}},
        }
    )


def dataloader(rows: int = 64, chunk: int = BATCH, offset: int = 0) -> list[dict[str, Any]]:
    """What verl's StatefulDataLoader yields: dicts of per-row numpy columns (from row ``offset`` on)."""
    return [
        {
            "raw_prompt": np.array([f"prompt {i}" for i in range(start, start + chunk)], dtype=object),
            "index": np.arange(start, start + chunk),
        }
        for start in range(offset, offset + rows, chunk)
    ]


def make_trainer(
    mode: str = "sync",
    k: int = 1,
    dapo: bool = False,
    uniform: frozenset[int] = frozenset(),
    short: frozenset[int] = frozenset(),
    offset: int = 0,
) -> Any:
    """verl's real V1 trainer class with only the state its submit path reads.

    ``dapo``: group filtering on, as ``PPOTrainer._build_replay_buffer`` sets it up: the buffer
    refills through the trainer's real (patched) ``_add_prompts_to_generate``, one prompt per fetch.
    """
    config = run_config(mode, k, dapo)
    trainer = object.__new__(get_trainer_cls(mode))
    trainer.config = config
    trainer.trainer_mode = mode
    trainer.parameter_sync_step = k
    trainer.train_dataloader = dataloader(chunk=config.data.gen_batch_size or BATCH, offset=offset)
    trainer.train_dataloader_it = None
    trainer.global_steps = 0
    trainer.agent_loop_manager = StandInAgentLoopManager(uniform, short)
    buffer_cls = ReplayBuffer if mode == "sync" else ReplayBufferAsync
    sync_gen_batch = 1 if dapo else BATCH
    trainer.replay_buffer = buffer_cls(
        trainer_mode=mode,
        trainer_config=config.trainer.v1[mode],
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        poll_interval=0.05,
        refill_fn=trainer._add_prompts_to_generate,
        filter_groups_metric="reward" if dapo else None,
        train_batch_size=BATCH if mode == "sync" else None,
        gen_batch_size=sync_gen_batch if mode == "sync" else None,
    )
    CLOCK.enter(trainer)
    return trainer


FIELDS = ["responses", "raw_prompt", "uid", "session_id", "global_steps"]


def train_step(trainer: Any, step: int, fields: list[str] = FIELDS) -> dict[str, list[Any]]:
    """What PPOTrainer.fit/step do around the rollout: submit, sample k mini-batches, clear the step.

    Returns what the trainer got: keys, tags and ``fields`` read back before the step is cleared.
    """
    trainer.global_steps = step
    trainer._add_batch_to_generate()
    got: dict[str, list[Any]] = {"keys": [], "tags": [], **{name: [] for name in fields}}
    for _ in range(trainer.parameter_sync_step):
        batch, _ = trainer.replay_buffer.sample(
            global_steps=step, partition_id="train", batch_size=BATCH // trainer.parameter_sync_step
        )
        got["keys"].extend(batch.keys)
        got["tags"].extend(batch.tags)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        for name in fields:
            value = data[name]
            got[name].extend([t.tolist() for t in value.unbind(0)] if isinstance(value, torch.Tensor) else list(value))
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
    return got


def responses(got: dict[str, list[Any]]) -> list[list[int]]:
    return sorted(got["responses"])


class Session:
    """One "run": an engine with a fresh rollout_tq role patched into verl, removed on exit."""

    def __init__(self, dump: Path, steps: tuple[int, ...] = (1, 2), **settings: Any) -> None:
        cfg = RoleConfig(enable=True, dump_dir=str(dump), steps=steps, **settings)
        self.engine = Engine(Config(roles={"rollout_tq": cfg}), {"rollout_tq": (make_role(), "test")})

    def __enter__(self) -> Engine:
        self.engine.start()
        return self.engine

    def __exit__(self, *exc: object) -> None:
        self.engine.stop()


@pytest.mark.ray
def test_sync_miss_saves_then_hit_injects_without_generating(tmp_path: Path, clean_tq: None, caplog):
    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=BATCH)
    with Session(dump):
        trainer = make_trainer()
        first = {step: train_step(trainer, step) for step in (1, 2, 3)}
    assert len(trainer.agent_loop_manager.calls) == 3
    assert sorted(p.name for p in layout.iterdir()) == ["1", "2"], "step 3 is not in skip.steps"
    meta = json.loads((layout / "1" / "meta.json").read_text())
    assert meta["role"] == "rollout_tq" and meta["rows"] == BATCH * N and [p["dir"] for p in meta["parts"]] == ["0"]

    with Session(dump), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer()
        second = {step: train_step(trainer, step) for step in (1, 2, 3)}
    calls = trainer.agent_loop_manager.calls
    assert len(calls) == 1, "only step 3 (not cached) is generated"
    hits = [r.getMessage() for r in caplog.records if "hit, served step" in r.getMessage()]
    assert len(hits) == 2 and "injected 8 cached trajectories (4 prompts x n=2)" in hits[0], hits
    for step in (1, 2):
        assert responses(second[step]) == responses(first[step]), f"step {step}"
    # The dataloader advanced on the served steps: step 3 got the same prompts as in run 1.
    assert second[3]["raw_prompt"] == first[3]["raw_prompt"]
    # Injected rows carry the new uids, in data and keys alike (GRPO groups by the uid field).
    data, keys = second[1], second[1]["keys"]
    assert data["uid"] == [key.split("_")[0] for key in keys]
    assert data["session_id"] == [int(key.split("_")[1]) for key in keys]
    assert set(data["global_steps"]) == {1}
    assert all(
        tag["global_steps"] == tag["min_global_steps"] == tag["max_global_steps"] == 1 for tag in second[1]["tags"]
    )


# Rows 4-7 are step 2's submit (one prompt per fetch): 5 and 6 get uniform rewards, so group filtering
# evicts them and the replay buffer refills 2 x 2 = 4 prompts (rows 8-11) before it samples.
UNIFORM = frozenset({5, 6})


def messages_of(caplog: pytest.LogCaptureFixture, text: str, level: int = logging.INFO) -> list[str]:
    """skipinject's log lines holding ``text``, at ``level`` or above."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "skipinject" and text in r.getMessage() and r.levelno >= level
    ]


@pytest.mark.ray
@pytest.mark.parametrize(
    ("mode", "k", "refill"),
    [
        # sync: 2 evictions give 2 x 2 = 4 refill credits; one in-flight batch of 4 fits them all (rows 8-11),
        # then the surplus of 2 sampleable groups is dropped.
        pytest.param("sync", 1, 4, id="sync"),
        # async: each evicted group is replaced by one refill (rows 8-9); two mini-batches of 2.
        pytest.param("separate_async", 2, 2, id="separate_k2"),
    ],
)
def test_dapo_served_step_draws_what_the_recorded_step_drew_and_generates_nothing(
    tmp_path: Path, clean_tq: None, caplog, mode: str, k: int, refill: int
):
    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=1)
    drawn = BATCH + refill
    with Session(dump, steps=(2,)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer(mode, k, dapo=True, uniform=UNIFORM)
        first = {step: train_step(trainer, step) for step in (1, 2, 3)}
    step3 = list(range(4 + drawn, 8 + drawn))
    assert trainer.agent_loop_manager.indices == [[0, 1, 2, 3], [4, 5, 6, 7], list(range(8, 4 + drawn)), step3]
    meta = json.loads((layout / "2" / "meta.json").read_text())
    assert meta["rows"] == BATCH * N and len(meta["parts"]) == k
    record = (meta["prompts_drawn"], meta["prompts_submitted"], meta["refills"], meta["carried_over"])
    assert record == (drawn, BATCH, [refill], 0)
    assert len(messages_of(caplog, f"rollout_tq step 2: refill of {refill} prompts generated")) == 1
    assert len(messages_of(caplog, f"the step drew {drawn} prompts ({BATCH} + refills [{refill}])")) == 1
    caplog.clear()

    with Session(dump, steps=(2,)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer(mode, k, dapo=True, uniform=UNIFORM)
        second = {step: train_step(trainer, step) for step in (1, 2, 3)}
    # Step 2 was served: no submit, no refill. It drew what run 1 drew, so step 3 got run 1's prompts.
    assert trainer.agent_loop_manager.indices == [[0, 1, 2, 3], step3]
    assert responses(second[2]) == responses(first[2]), "trained on what run 1 sampled at step 2"
    assert sorted(map(str, second[3]["raw_prompt"])) == sorted(map(str, first[3]["raw_prompt"]))
    [hit] = messages_of(caplog, "hit, served step 2")
    assert f"drew {drawn} prompts as the recorded step did ({BATCH} + {refill} that its refills drew" in hit
    assert not messages_of(caplog, "", logging.WARNING), "an exact replay warns of nothing"
    assert not (layout / "3").exists()


@pytest.mark.ray
def test_a_record_without_its_draws_serves_the_step_and_says_the_dataloader_may_drift(
    tmp_path: Path, clean_tq: None, caplog
):
    # verl's own cache (tq_batch.pt, trusted) records no draws: the step is served, the dataloader
    # gives the submit's prompts only, and the hit line says later steps may see other prompts.
    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=1)
    with Session(dump, steps=(2,)):
        trainer = make_trainer(dapo=True, uniform=UNIFORM)
        for step in (1, 2):
            train_step(trainer, step)
    store = _store(layout, step=2)
    payload = TensorDictCodec().decode(store.load(store.verified(2))[0])
    for path in (layout / "2").rglob("*"):
        if path.is_file():
            path.unlink()
    (layout / "2" / "0").mkdir(exist_ok=True)
    torch.save(payload, layout / "2" / "0" / "tq_batch.pt")
    clear_tq()

    with Session(dump, steps=(2,), trust_upstream=True), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer(dapo=True, uniform=UNIFORM)
        for step in (1, 2, 3):
            train_step(trainer, step)
    assert trainer.agent_loop_manager.indices == [[0, 1, 2, 3], [8, 9, 10, 11]], "step 3 drew right after the submit"
    [hit] = messages_of(caplog, "hit, served step 2", logging.WARNING)
    assert "the record does not say how many prompts the step drew" in hit
    assert "later steps may see other prompts than the recorded run" in hit


@pytest.mark.ray
def test_a_refill_at_a_served_step_is_generated_and_said(tmp_path: Path, clean_tq: None, caplog):
    # Row 2's group has one trajectory (a failed session): it passes the filter in run 1, but served
    # to n=2 sessions it is cycled into two equal ones, which the filter evicts in run 2.
    dump = tmp_path / "dump"
    with Session(dump, steps=(1,)):
        trainer = make_trainer(dapo=True, short=frozenset({2}))
        first = train_step(trainer, 1)
    assert len(first["keys"]) == BATCH * N - 1

    with Session(dump, steps=(1,)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer(dapo=True)
        train_step(trainer, 1)
        train_step(trainer, 2)
    assert trainer.agent_loop_manager.indices == [[4, 5], [6, 7, 8, 9]], "the refill ran; step 2 drew after it"
    [warning] = messages_of(caplog, "rollout_tq step 1: the replay buffer asks for 2 more prompts", logging.WARNING)
    assert "generating them" in warning and "2 prompts ahead of the recorded run" in warning


@pytest.mark.ray
def test_groups_left_in_the_buffer_around_a_served_step_are_said(tmp_path: Path, clean_tq: None, caplog):
    # A group of an earlier step in the buffer (as a resumed run re-issues them): sync sampling takes the
    # oldest first, so one of step 2's own groups is left over, and the record says so.
    def foreign(step: int) -> None:
        put_trajectories("old", step - 1, seed=40, sessions=range(N))
        tq.kv_put(key="old", partition_id="train", tag={"is_prompt": True, "status": "finished", "global_steps": 1})

    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=BATCH)
    with Session(dump, steps=(2,)):
        trainer = make_trainer()
        train_step(trainer, 1)
        trainer.global_steps = 2
        foreign(2)
        recorded = train_step(trainer, 2)
    assert "old_0_0" in recorded["keys"]
    meta = json.loads((layout / "2" / "meta.json").read_text())
    assert (meta["prompts_drawn"], meta["carried_over"]) == (4, 1)
    clear_tq()

    with Session(dump, steps=(2,)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer()
        train_step(trainer, 1)
        train_step(trainer, 2)
        train_step(trainer, 3)
    [after] = messages_of(caplog, "rollout_tq step 3: served step 2's record says", logging.WARNING)
    assert "carried 1 prompt groups" in after and "step 3 trains on other prompts than the recorded run" in after
    clear_tq()

    caplog.clear()
    with Session(dump, steps=(2,)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer()
        train_step(trainer, 1)
        trainer.global_steps = 2
        foreign(2)
        train_step(trainer, 2)
    [hit] = messages_of(caplog, "hit, served step 2", logging.WARNING)
    assert "1 prompt groups of earlier steps are still in the replay buffer" in hit


@pytest.mark.ray
def test_repeat_serves_the_nearest_cached_step_and_does_not_save_it(tmp_path: Path, clean_tq: None, caplog):
    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=BATCH)
    with Session(dump, steps=(2,)):
        trainer = make_trainer()
        train_step(trainer, 1)
        cached = train_step(trainer, 2)
    with Session(dump, steps=(1, 3), action="repeat"), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer()
        served = {step: train_step(trainer, step) for step in (1, 2, 3)}
    assert len(trainer.agent_loop_manager.calls) == 1, "only step 2 (not in skip.steps this run) is generated"
    messages = [r.getMessage() for r in caplog.records]
    assert any("step 1: hit, served step 2 (repeat: no cached step below 1, smallest above)" in m for m in messages)
    assert any("step 3: hit, served step 2 (repeat: largest cached step below 3)" in m for m in messages)
    assert responses(served[1]) == responses(served[3]) == responses(cached)
    assert sorted(p.name for p in layout.iterdir()) == ["2"], "served steps are not saved as their own"


@pytest.mark.ray
def test_inject_remaps_into_real_transfer_queue(tmp_path: Path, clean_tq: None):
    # Cache 3 groups (one lost a session) through TransferQueue, as the sample phase reads them.
    keys = put_trajectories("a", 5, seed=1, sessions=range(2)) + put_trajectories("b", 5, seed=2, sessions=range(1))
    keys += put_trajectories("c", 5, seed=3, sessions=range(2))
    tags = [dict(tag) for tag in tq.kv_list("train")["train"].values()]
    source = tq.kv_batch_get(keys=keys, partition_id="train")
    tq.kv_clear(keys=keys, partition_id="train")
    cached = CachedBatch(source, keys, tags)

    uids = ["u0", "u1", "u2", "u3"]
    plan = inject(prepare(cached, uids, N, step=9))
    listing = tq.kv_list("train")["train"]
    for uid in uids:
        assert listing[uid] == {"is_prompt": True, "status": "finished", "global_steps": 9}
    for key, tag in zip(plan.keys, plan.tags, strict=True):
        assert listing[key] == tag and "is_prompt" not in tag and tag["max_global_steps"] == 9
    got = tq.kv_batch_get(keys=plan.keys, partition_id="train")
    src_responses = [t.tolist() for t in source["responses"].unbind(0)]
    assert [t.tolist() for t in got["responses"].unbind(0)] == [src_responses[row] for row in plan.rows]
    assert list(got["uid"]) == plan.uids  # u3 took group a again, under its own uid

    # The real replay buffer samples exactly the injected groups.
    buffer = ReplayBuffer("sync", {}, None, "drop", {}, poll_interval=0.05, train_batch_size=4, gen_batch_size=4)
    batch, _ = buffer.sample(global_steps=9, partition_id="train", batch_size=4)
    assert sorted(batch.keys) == sorted(plan.keys)


@pytest.mark.ray
def test_jagged_fields_survive_save_load_and_row_selection(tmp_path: Path, clean_tq: None):
    keys = put_trajectories("a", 1, seed=4, sessions=range(2)) + put_trajectories("b", 1, seed=5, sessions=range(2))
    data = tq.kv_batch_get(keys=keys, partition_id="train")
    assert data["responses"].is_nested and data["responses"].layout == torch.jagged
    codec = TensorDictCodec()
    store = StepStore(tmp_path, "rollout_tq", {})
    store.save(1, codec.encode({"tensordict": data, "keys": keys, "tags": [{}] * 4, "global_steps": 1}))
    loaded = CachedBatch.from_payloads([codec.decode(p) for p in store.load(store.verified(1))], codec.merge)
    assert loaded.data["responses"].layout == torch.jagged
    plan = remap(loaded.keys, loaded.tags, ["x", "y", "z"], N, step=2)
    selected = select_rows(loaded.data, plan, step=2)
    for name in ("prompts", "responses", "input_ids", "rm_scores"):
        original = data[name].unbind(0)
        assert [t.tolist() for t in selected[name].unbind(0)] == [original[r].tolist() for r in plan.rows], name
    assert [x["acc"] for x in (e["reward_extra_info"] for e in selected["extra_fields"])] == [
        list(data["extra_fields"])[r]["reward_extra_info"]["acc"] for r in plan.rows
    ]
    # The selection is a copy: TransferQueue accepts it and the cached rows are untouched.
    tq.kv_batch_put(keys=plan.keys, fields=selected, tags=plan.tags, partition_id="train")
    again = CachedBatch.from_payloads([codec.decode(p) for p in store.load(store.verified(1))], codec.merge)
    assert [t.tolist() for t in again.data["responses"].unbind(0)] == [t.tolist() for t in data["responses"].unbind(0)]


@pytest.mark.ray
def test_parameter_sync_step_parts_and_interrupted_step(tmp_path: Path, clean_tq: None, caplog):
    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=1)
    with Session(dump, steps=(1, 2, 3)) as engine:
        trainer = make_trainer("separate_async", k=2)
        assert parameter_sync_step(trainer.config) == 2
        first = train_step(trainer, 1)
        # Step 2: one of two mini-batches sampled, then the process "dies" (the run is dropped as is:
        # a killed process runs no end-of-run hook, so its open step is neither committed nor aborted).
        trainer.global_steps = 2
        trainer._add_batch_to_generate()
        trainer.replay_buffer.sample(global_steps=2, partition_id="train", batch_size=2)
        engine.runtimes["rollout_tq"].recorder.steps.take_all()
    assert len(trainer.agent_loop_manager.calls) == 2
    meta = json.loads((layout / "1" / "meta.json").read_text())
    assert [p["dir"] for p in meta["parts"]] == ["0", "1"] and meta["rows"] == BATCH * N
    assert list((layout / "2" / "0").glob("tensors-*")), "part 0 of step 2 was written"
    assert not (layout / "2" / "meta.json").exists(), "but step 2 was never committed"
    orphan = {p.name for p in (layout / "2" / "0").iterdir()}
    clear_tq()  # the dead run's TransferQueue is gone too

    with Session(dump, steps=(1, 2, 3)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer("separate_async", k=2)
        second = train_step(trainer, 1)
        regenerated = train_step(trainer, 2)
        # Step 3: one mini-batch, then step 4 samples: step 3's open writer is aborted, never committed.
        trainer.global_steps = 3
        trainer._add_batch_to_generate()
        trainer.replay_buffer.sample(global_steps=3, partition_id="train", batch_size=2)
        assert list((layout / "3" / "0").glob("tensors-*"))
        CLOCK.instance.global_steps = 4
        trainer.replay_buffer.sample(global_steps=4, partition_id="train", batch_size=2)
    calls = trainer.agent_loop_manager.calls
    assert len(calls) == 2, "step 1 was served from both parts; steps 2 and 3 were generated"
    assert responses(second) == responses(first), "both mini-batches of step 1 merged"
    assert len(regenerated["keys"]) == BATCH * N
    meta2 = json.loads((layout / "2" / "meta.json").read_text())
    named = {part["files"][kind]["name"] for part in meta2["parts"] for kind in ("tensors", "objects")}
    assert [p["dir"] for p in meta2["parts"]] == ["0", "1"] and not named & orphan, "no part of the dead run is used"
    assert not (layout / "3" / "meta.json").exists() and not list((layout / "3" / "0").glob("tensors-*"))
    messages = [r.getMessage() for r in caplog.records]
    assert any("rollout_tq step 2:" in m and ("interrupted" in m or "miss" in m) for m in messages), messages
    assert any(
        "step 3: could not save" in m and "1 part(s) recorded and not committed before step 4 began" in m
        for m in messages
    )
    assert any("rollout_tq step 2: saved 8 trajectories in 2 part(s)" in m for m in messages), messages
    assert not any("step 1: saved" in m or "step 3: saved" in m for m in messages), messages


@pytest.mark.ray
def test_upstream_tq_batch_is_reported_not_loaded_unless_trusted(tmp_path: Path, clean_tq: None, caplog):
    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=BATCH)
    with Session(dump, steps=(1,)):
        trainer = make_trainer()
        first = train_step(trainer, 1)
    # Rewrite step 1 as verl's own SkipManager leaves it: {step}/0/tq_batch.pt (a pickle) + meta.json.
    store = _store(layout)
    payload = TensorDictCodec().decode(store.load(store.verified(1))[0])
    for path in (layout / "1").rglob("*"):
        if path.is_file():
            path.unlink()
    (layout / "1" / "0").mkdir(exist_ok=True)
    torch.save(payload, layout / "1" / "0" / "tq_batch.pt")
    (layout / "1" / "0" / "meta.json").write_text(json.dumps({"global_steps": 1}))

    with Session(dump, steps=(1,)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer()
        train_step(trainer, 1)
    assert len(trainer.agent_loop_manager.calls) == 1, "untrusted: generated again"
    assert sum("did not load it" in r.getMessage() for r in caplog.records) == 1
    assert (layout / "1" / "0" / "tq_batch.pt").is_file(), "never deleted"
    assert (layout / "1" / "meta.json").is_file(), "cached again in skipinject's format beside it"

    (layout / "1" / "meta.json").unlink()
    with Session(dump, steps=(1,), trust_upstream=True):
        trainer = make_trainer()
        trusted = train_step(trainer, 1)
    assert trainer.agent_loop_manager.calls == [], "trusted: loaded and injected"
    assert responses(trusted) == responses(first)


def _store(layout: Path, step: int = 1) -> StepStore:
    meta = json.loads((layout / str(step) / "meta.json").read_text())
    return StepStore(layout, "rollout_tq", meta["context"])


@pytest.mark.ray
def test_validation_samples_are_not_saved(tmp_path: Path, clean_tq: None):
    dump = tmp_path / "dump"
    with Session(dump, steps=(1,)):
        trainer = make_trainer()
        trainer.global_steps = 1
        put_trajectories("v", 1, seed=1, sessions=range(N), partition="val")
        tq.kv_put(key="v", partition_id="val", tag={"is_prompt": True, "status": "finished", "global_steps": 1})
        batch, _ = trainer.replay_buffer.sample(global_steps=1, partition_id="val", batch_size=1)
    assert sorted(batch.keys) == ["v_0_0", "v_1_0"]
    assert not dump.exists()


@pytest.mark.skipif(not installed_verl_matches(">=0.9.1"), reason="_add_async_warmup_batches: verl >= 0.9.1")
def test_async_warmup_prefetch_is_off_only_while_the_role_is_enabled(tmp_path: Path, caplog):
    trainer = object.__new__(get_trainer_cls("separate_async"))
    trainer.config = run_config("separate_async", 2)
    trainer._restored_tq_prompt_count = 0
    added: list[int] = []
    trainer._add_prompts_to_generate = added.append
    trainer.global_steps = 1
    CLOCK.enter(trainer)
    with Session(tmp_path, steps=(5,)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer._add_async_warmup_batches(1)
        trainer._add_async_warmup_batches(1)
    assert added == [], "no prefetch while enabled, even at steps outside skip.steps"
    assert sum("warm-up prefetch switched off" in r.getMessage() for r in caplog.records) == 1
    trainer._add_async_warmup_batches(1)
    assert added == [BATCH], "the original runs again once the role is gone"


# ---------------------------------------------------------------- saves off the training step


class GatedWrites:
    """Holds every part write of the store until ``open()``: shows what waits for the disk."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_part: str | None = None) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        real = StepWriter.add_part

        def add_part(writer: StepWriter, payload: Any, part: str = "") -> None:
            self.started.set()
            assert self.gate.wait(120), "the test never opened the gate"
            if part == fail_part:
                raise OSError(28, "No space left on device")
            real(writer, payload, part)

        monkeypatch.setattr(StepWriter, "add_part", add_part)

    def open(self) -> None:
        self.gate.set()


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> GatedWrites:
    return GatedWrites(monkeypatch)


def _in_thread(work: Any) -> tuple[threading.Thread, list[Any]]:
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(work()), daemon=True)
    thread.start()
    return thread, done


@pytest.mark.skipif(
    not installed_verl_matches(">=0.9,<0.9.1"), reason="verl 0.9.0's async modes warm up in on_train_begin"
)
@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_verl_0_9_0_warm_up_in_on_train_begin_is_off_while_the_role_is_enabled(tmp_path: Path, caplog, mode: str):
    """verl 0.9.0 has no ``_add_async_warmup_batches``: its async modes' ``on_train_begin`` submits the warm-up
    batches through the submit target at step 1. Run in verl 0.9.0's environment (``.venvs/verl-0.9.0``)."""
    trainer = object.__new__(get_trainer_cls(mode))
    trainer.config = run_config(mode, 1)
    OmegaConf.update(trainer.config, f"trainer.v1.{mode}.num_warmup_batches", 2)
    submitted: list[int] = []
    trainer._add_batch_to_generate = lambda: submitted.append(trainer.global_steps)
    trainer.global_steps = 1
    CLOCK.enter(trainer)
    with Session(tmp_path, steps=(5,)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer.on_train_begin()
        trainer.on_train_begin()
    assert submitted == [], "no warm-up submit while enabled, even at steps outside skip.steps"
    assert sum("warm-up prefetch switched off" in r.getMessage() for r in caplog.records) == 1
    trainer.on_train_begin()
    assert submitted == [1, 1], "the original warms up again once the role is gone"


@pytest.mark.ray
@pytest.mark.background_saves
def test_a_miss_step_does_not_wait_for_the_disk_and_saves_what_was_sampled(
    tmp_path: Path, clean_tq: None, writes: GatedWrites
):
    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=BATCH)
    with Session(dump, steps=(1,)):
        trainer = make_trainer()
        thread, done = _in_thread(lambda: train_step(trainer, 1))
        thread.join(120)
        assert done, "the training step waited for the cache write"
        assert writes.started.wait(60), "the write runs in the background"
        assert not (layout / "1" / "meta.json").exists(), "not committed while its write is held"
        # TransferQueue's copy is gone (cleared by the step) and its keys hold other data now.
        sampled = responses(done[0])
        put_trajectories(done[0]["keys"][0].split("_")[0], 1, seed=99, sessions=range(N))
        writes.open()
        WRITER.flush()
        assert (layout / "1" / "meta.json").exists()
    clear_tq()
    with Session(dump, steps=(1,)):
        trainer = make_trainer()
        served = train_step(trainer, 1)
    assert trainer.agent_loop_manager.calls == [], "step 1 was served"
    assert responses(served) == sampled, "the cache holds what training sampled, not what came later"


@pytest.mark.ray
@pytest.mark.background_saves
def test_the_next_submit_waits_for_the_pending_save_of_its_store(tmp_path: Path, clean_tq: None, writes: GatedWrites):
    layout = tmp_path / "dump" / LAYOUT.format(gbs=BATCH)
    with Session(tmp_path / "dump", steps=(1, 2), action="repeat"):
        trainer = make_trainer()
        train_step(trainer, 1)
        thread, done = _in_thread(lambda: train_step(trainer, 2))
        thread.join(2)
        assert not done, "step 2's submit reads the store: it waits for step 1's save"
        writes.open()
        thread.join(120)
        assert done
    assert len(trainer.agent_loop_manager.calls) == 1, "step 1 was generated, step 2 served"
    assert sorted(p.name for p in layout.iterdir()) == ["1"], "step 2 was served from step 1 (repeat), not saved"


@pytest.mark.ray
@pytest.mark.background_saves
def test_a_failed_background_part_leaves_no_step_and_drops_the_later_part(
    tmp_path: Path, clean_tq: None, monkeypatch: pytest.MonkeyPatch, caplog
):
    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=1)
    writes = GatedWrites(monkeypatch, fail_part="0")
    writes.open()
    with Session(dump, steps=(1,)), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer("separate_async", k=2)
        got = train_step(trainer, 1)
        WRITER.flush()
    assert len(got["keys"]) == BATCH * N, "training got both mini-batches"
    assert not (layout / "1" / "meta.json").exists()
    assert not list(layout.rglob("tensors-*")), "nothing of the failed step is left"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("could not save" in m and "cannot write part 1" in m and "No space left" in m for m in messages) == 1
    assert not any(": saved" in m for m in messages), messages


# ---------------------------------------------------------------- action=match


def trained_rows(got: dict[str, list[Any]]) -> list[tuple[str, int, list[int]]]:
    """(prompt, session, response) of each trained trajectory, sorted."""
    return sorted(
        (str(prompt[0]["content"]) if isinstance(prompt, list) else str(prompt), session, response)
        for prompt, session, response in zip(got["raw_prompt"], got["session_id"], got["responses"], strict=True)
    )


def own_rows(indices: range, step: int) -> list[tuple[str, int, list[int]]]:
    """What the stand-in generates for dataset rows ``indices``: each row's response is its own prompt's."""
    rows = []
    for index in indices:
        for session in range(N):
            fields = trajectory("u", session, step, seed=index)
            rows.append((f"prompt {index}", session, fields["responses"].tolist()))
    return sorted(rows)


@pytest.mark.ray
def test_match_serves_cached_prompts_and_submits_only_the_others(tmp_path: Path, clean_tq: None, caplog):
    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=BATCH)
    with Session(dump):  # action=cache records steps 1-2 (rows 0-7) with their row keys
        trainer = make_trainer()
        first = {step: train_step(trainer, step) for step in (1, 2)}
    meta = json.loads((layout / "1" / "meta.json").read_text())
    assert len(meta["row_keys"]) == 1 and len(meta["row_keys"][0]) == BATCH * N and meta["rows_per_input"] == [1]

    TALLY.clear()
    # Run 2 draws from row 2 on: step 1 = rows 2-5 (all cached, in steps 1 and 2), step 2 = rows 6-9 (6-7
    # cached), step 3 = rows 10-13 (none).
    with Session(dump, steps=(1, 2, 3), action="match"), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer(offset=2)
        second = {step: train_step(trainer, step) for step in (1, 2, 3)}
    assert trainer.agent_loop_manager.indices == [[8, 9], [10, 11, 12, 13]], "only the uncached prompts generated"
    counted = TALLY.roles["rollout_tq"]  # the run's summary: rows served and generated
    assert (counted["served_rows"], counted["generated_rows"]) == (12, 12), counted
    TALLY.clear()
    assert trained_rows(second[1]) == own_rows(range(2, 6), 1)
    assert trained_rows(second[2]) == own_rows(range(6, 10), 2)
    recorded = [row for step in (1, 2) for row in trained_rows(first[step])]
    assert all(row in recorded for row in trained_rows(second[1]) + trained_rows(second[2])[:4]), "run 1's rows"
    [line1] = messages_of(caplog, "rollout_tq step 1: match (submit)")
    assert "4 of 4 prompts served (8 trajectories from step 1 (4), step 2 (4))" in line1
    assert line1.endswith("rollout not submitted")
    [line2] = messages_of(caplog, "rollout_tq step 2: match (submit)")
    assert "2 of 4 prompts served (4 trajectories from step 2 (4))" in line2 and line2.endswith(
        "2 submitted for generation"
    )
    # Served rows carry this step's uids, sessions and step tags.
    data = second[2]
    assert data["uid"] == [key.split("_")[0] for key in data["keys"]]
    assert data["session_id"] == [int(key.split("_")[1]) for key in data["keys"]]
    assert set(data["global_steps"]) == {2} and all(tag["global_steps"] == 2 for tag in data["tags"])
    # Step 2 was committed by run 1 (never rewritten): its new rows are a rows record; step 3 is new.
    assert sorted(p.name for p in layout.iterdir() if p.name.isdigit()) == ["1", "2", "3"]
    assert (layout / "rows" / "1" / "meta.json").is_file()
    assert messages_of(caplog, "rollout_tq step 2: saved 4 new rows to")
    caplog.clear()

    # Run 3 draws rows 8-15: 8-9 from the rows record, 10-13 from step 3; 14-15 are new.
    with Session(dump, steps=(1, 2), action="match"), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer(offset=8)
        third = {step: train_step(trainer, step) for step in (1, 2)}
    assert trainer.agent_loop_manager.indices == [[14, 15]]
    assert trained_rows(third[1]) == own_rows(range(8, 12), 1)
    assert trained_rows(third[2]) == own_rows(range(12, 16), 2)
    [line] = messages_of(caplog, "rollout_tq step 1: match (submit)")
    assert "4 of 4 prompts served" in line and "rows 1 (4)" in line and "step 3 (4)" in line


def prompt_indices(got: dict[str, list[Any]]) -> set[int]:
    return {int(row[0].split()[1]) for row in trained_rows(got)}


@pytest.mark.ray
@pytest.mark.parametrize(
    ("mode", "k"), [pytest.param("sync", 1, id="sync"), pytest.param("separate_async", 2, id="k2")]
)
def test_match_with_group_filtering_matches_the_refills_too(tmp_path: Path, clean_tq: None, caplog, mode: str, k: int):
    dump = tmp_path / "dump"
    with Session(dump, steps=(1, 2)):
        trainer = make_trainer(mode, k, dapo=True, uniform=UNIFORM)
        first = {step: train_step(trainer, step) for step in (1, 2)}
    recorded = prompt_indices(first[1]) | prompt_indices(first[2])

    with Session(dump, steps=(1, 2), action="match"), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer(mode, k, dapo=True, uniform=UNIFORM)
        second = {step: train_step(trainer, step) for step in (1, 2)}
    generated = [index for call in trainer.agent_loop_manager.indices for index in call]
    assert generated and not set(generated) & recorded, "a prompt trained in run 1 is never generated again"
    assert {5, 6} <= set(generated), "the evicted prompts were not recorded: generated (and evicted) again"
    for step in (1, 2):
        rows = trained_rows(second[step])
        assert rows == own_rows(sorted(prompt_indices(second[step])), step), "each response is its own prompt's"
    refills = messages_of(caplog, "rollout_tq step 2: match (refill)")
    assert refills and any("prompts served" in line and " 0 of" not in line for line in refills), refills
    assert not messages_of(caplog, "action=match is not exact"), "said at the run's start, not in the run"


@pytest.mark.parametrize(
    ("mode", "k", "action", "why"),
    [
        pytest.param("separate_async", 2, "match", "trainer.v1.trainer_mode=separate_async: ", id="async"),
        pytest.param("sync", 2, "match", "parameter_sync_step=2: ", id="sync-k2"),
        pytest.param("sync", 1, "match", None, id="sync"),
        pytest.param("separate_async", 2, "cache", None, id="cache"),
    ],
)
def test_match_says_at_the_runs_start_once_why_it_is_not_exact(
    tmp_path: Path, caplog, mode: str, k: int, action: str, why: str | None
):
    """The driver's start lines (verl hands ``run_ppo`` its config) say, once, which mode keeps ``match``
    from being exact and why; an exact mode or another action says nothing of it."""
    from skipinject.report import start

    settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1, 2), action=action)
    watch = start.RunStart(Config(roles={"rollout_tq": settings}), {"rollout_tq": make_role()})
    config = run_config(mode, k)
    with caplog.at_level(logging.INFO, logger="skipinject"):
        for _ in range(2):
            watch.sync(SimpleNamespace(args=(config,), kwargs={}), lambda: None)
    lines = messages_of(caplog, "rollout_tq: ")
    inexact = [line for line in lines if "not exact" in line]
    if why is None:
        assert not inexact and len(lines) == 1, lines
        return
    assert len(lines) == 2 and lines[0].startswith(f"rollout_tq: {action} steps 1-2 in "), lines
    assert inexact == [lines[1]] and lines[1].startswith(f"rollout_tq: action=match is not exact with {why}")
    assert messages_of(caplog, "not exact", logging.WARNING) == inexact


@pytest.mark.ray
def test_match_generates_rows_a_v0_recording_cannot_carry_and_says_why(tmp_path: Path, clean_tq: None, caplog):
    """A V0 ``rollout`` recording whose row keys are this submit's (the same prompts and generation
    settings) but whose rows lack a field a V1 trajectory is made of: they are generated, one line names it."""
    from skipinject.verl.codecs import DataProtoCodec
    from verl.protocol import DataProto

    dump = tmp_path / "dump"
    layout = dump / LAYOUT.format(gbs=BATCH)
    with Session(dump, steps=(1,)):
        train_step(make_trainer(), 1)
    meta = json.loads((layout / "1" / "meta.json").read_text())
    store = _store(layout)
    rows = BATCH * N
    v0 = DataProto.from_dict(
        tensors={"responses": torch.zeros(rows, 4, dtype=torch.int64)},
        non_tensors={"raw_prompt": np.array([f"prompt {i // N}" for i in range(rows)], dtype=object)},
    )
    v0_meta = {"role": "rollout", "row_keys": meta["row_keys"], "rows_per_input": [1], "calls": 1}
    store.remove(1)
    store.save(5, DataProtoCodec().encode(v0), v0_meta)
    assert not (layout / "1").exists()

    with Session(dump, steps=(1,), action="match"), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer()
        got = train_step(trainer, 1)
    assert trainer.agent_loop_manager.indices == [[0, 1, 2, 3]], "every prompt generated"
    assert trained_rows(got) == own_rows(range(4), 1)
    [why] = messages_of(caplog, "cached step 5 of", logging.WARNING)
    assert "field 'prompts' cannot be carried exactly between the trainers' formats" in why
    assert "the V0 recording does not hold it" in why


def test_a_v1_prompt_is_keyed_as_the_v0_rollout_keys_its_rows():
    """The same dataset rows, collated by verl and batched as each trainer batches them (V0: a
    ``DataProto`` repeated ``n`` times, interleaved; V1: the ``TensorDict`` of ``_fetch_one_gen_batch``),
    get the same row keys: a recording of either trainer is found by the other's ``match``."""
    from skipinject.engine.matching import row_keys
    from skipinject.roles import Call
    from skipinject_rollout.common import prompt_key
    from skipinject_rollout.rollout import ROLLOUT
    from skipinject_rollout_tq.plugin import ROLLOUT_TQ
    from skipinject_rollout_tq.transfer import batch_digests
    from verl.protocol import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import collate_fn

    rows = [
        {
            "raw_prompt": [{"role": "user", "content": f"question {i}"}],
            "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
            "data_source": "toy",
            "reward_model": {"ground_truth": str(i)},
            "extra_info": {"index": i},
            "index": i,
            "tools_kwargs": {},
            "interaction_kwargs": {},
        }
        for i in (0, 1, 0)  # a prompt twice in one batch: its copies are told apart
    ]
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": N, "temperature": 1.0}}})
    trainer = SimpleNamespace(config=config)
    v0 = DataProto.from_single_dict(collate_fn(rows)).repeat(repeat_times=N, interleave=True)
    v0_call = Call("t", print, trainer, (v0,), {})
    v0_digests = prompt_key(v0_call)
    assert v0_digests is not None
    v0_keys = row_keys(ROLLOUT, v0_call, v0_digests)
    digests = batch_digests(tu.get_tensordict(collate_fn(rows)))
    assert digests is not None
    v1_keys = row_keys(ROLLOUT_TQ, Call("t", print, trainer, (), {}), [d for d in digests for _ in range(N)])
    assert v1_keys == v0_keys and len(set(v0_keys)) == len(v0_keys)


@pytest.mark.ray
def test_match_rescores_the_served_trajectories_recorded_under_another_reward(tmp_path: Path, clean_tq: None, caplog):
    """``rescore`` on the match path: served trajectories recorded under another reward are scored by this
    run's real ``RewardLoopWorker`` before they are put into TransferQueue; generated ones keep theirs."""
    from plugins.rollout.tests.test_rescore import (
        LENGTH_REWARD,
        WORD_REWARD,
        InProcessHandle,
        harness,
        reward_file,
    )
    from plugins.rollout.tests.test_rescore import run_config as full_config
    from transformers import AutoTokenizer
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    assets = harness.build_assets(tmp_path / "assets")

    def v1_config(reward: str, source: str) -> Any:
        config = full_config(assets, reward_file(tmp_path, reward, source))
        OmegaConf.update(config, "trainer", dict(run_config().trainer), merge=True)
        config.data.train_batch_size, config.data.max_prompt_length, config.data.max_response_length = BATCH, 8, 8
        return config

    dump = tmp_path / "dump"
    fields = [*FIELDS, "rm_scores", "extra_fields"]
    with Session(dump, steps=(1,)):  # run 1, scored by the length reward, records rows 0-3
        trainer = make_trainer()
        trainer.config = v1_config("length.py", LENGTH_REWARD)
        train_step(trainer, 1)
    TALLY.clear()
    words = v1_config("words.py", WORD_REWARD)
    with Session(dump, steps=(1,), action="match"), caplog.at_level(logging.INFO, logger="skipinject"):
        trainer = make_trainer(offset=2)  # rows 2-5: 2-3 served, 4-5 generated
        trainer.config = words
        trainer.reward_loop_manager = SimpleNamespace(
            reward_loop_worker_handles=[InProcessHandle(RewardLoopWorker(words))]
        )
        got = train_step(trainer, 1, fields)
    assert trainer.agent_loop_manager.indices == [[4, 5]]
    tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir))
    for prompt, session, response, scores, extra in zip(
        got["raw_prompt"], got["session_id"], got["responses"], got["rm_scores"], got["extra_fields"], strict=True
    ):
        index = int(str(prompt[0]["content"] if isinstance(prompt, list) else prompt).split()[1])
        assert response == trajectory("u", session, 1, seed=index)["responses"].tolist(), "the recorded generation"
        if index < 4:  # served: this run's reward on its last response token
            count = len(tokenizer.decode(response, skip_special_tokens=True).split())
            assert scores == [0.0] * (len(response) - 1) + [10.0 * count], (index, session, scores)
            assert extra["reward_extra_info"] == {"score": 10.0 * count, "words": count}
        else:  # generated in this run: what its rollout scored
            expected = trajectory("u", session, 1, seed=index)["rm_scores"].tolist()
            assert scores == pytest.approx(expected), (index, session, scores)
    [line] = messages_of(caplog, "rollout_tq step 1: 4 rows re-scored")
    assert "words.py" in line and "length.py" in line
    assert TALLY.roles["rollout_tq"]["rescored_rows"] == 4, "the run's summary counts them"
    TALLY.clear()
