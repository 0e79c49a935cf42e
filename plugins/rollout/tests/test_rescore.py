"""A served rollout is scored by this run's reward (``skip.rollout.rescore``), on verl 0.9.1's own code:
the real ``AgentLoopManager.generate_sequences`` and a real ``RewardLoopWorker`` (in this process: its
actor handle is the only stand-in) running a toy reward function from a file, as verl loads it. The
agent-loop workers that would drive an LLM server are stand-ins replying with fixed token ids."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

import verl
from omegaconf import OmegaConf
from skipinject import RescorePolicy, bootstrap
from skipinject.report.tally import TALLY
from skipinject.testing import RoleRun
from skipinject_rollout import rescore
from skipinject_rollout.reward_identity import record_reward, reward_identity
from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncAgentLoopManager
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "verl_cpu"))
import harness

PROMPT_LEN, RESPONSE_LEN, N = 6, 4, 2
METRICS = {"generate_sequences": 1.0, "tool_calls": 0.0, "compute_score": 0.1, "num_preempted": 0}
PROMPTS = ["one two", "three four five", "six", "seven eight"]
LENGTH_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
    "    return float(len(solution_str))\n"
)
WORD_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
    "    words = len(solution_str.split())\n"
    "    return {'score': 10.0 * words, 'words': words}\n"
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return harness.build_assets(tmp_path_factory.mktemp("assets"))


def reward_file(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


def run_config(assets: Any, reward: Path | None, **reward_settings: Any) -> Any:
    """verl's own default trainer config, with this test's model and reward function."""
    config = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    config.trainer.experiment_name, config.trainer.project_name, config.trainer.use_v1 = "exp", "proj", False
    config.data.train_batch_size, config.data.gen_batch_size = 4, None
    config.data.max_prompt_length, config.data.max_response_length = PROMPT_LEN, RESPONSE_LEN
    config.actor_rollout_ref.rollout.n = N
    config.actor_rollout_ref.model.path = str(assets.model_dir)
    config.reward.custom_reward_function.path = None if reward is None else str(reward)
    for key, value in reward_settings.items():
        OmegaConf.update(config, key, value)
    return config


class InProcessHandle:
    """A Ray actor handle's ``method.remote(...)`` for a worker living in this process (the one stand-in).
    The worker's event loop runs in a thread of its own, as an actor's does: a caller may be inside a
    running loop (the fully async manager's)."""

    def __init__(self, worker: RewardLoopWorker) -> None:
        self.worker = worker
        self.batches: list[int] = []

    @property
    def compute_score_batch(self) -> Any:
        handle = self

        class Method:
            def remote(self, chunk: DataProto) -> Any:
                handle.batches.append(len(chunk))
                with concurrent.futures.ThreadPoolExecutor(1) as thread:
                    work = handle.worker.compute_score_batch(chunk)
                    return thread.submit(handle.worker.loop.run_until_complete, work).result()

        return Method()


class Generator:
    """Replies like an AgentLoopWorker with the reward loop on: fixed responses, rm_scores and acc."""

    def __init__(self, calls: list[int]) -> None:
        self.calls = calls
        outer = self

        class Method:
            def remote(self, chunk: DataProto) -> Any:
                future = asyncio.get_running_loop().create_future()
                future.set_result(outer.generate(chunk))
                return future

        self.generate_sequences = Method()

    def generate(self, chunk: DataProto) -> DataProto:
        self.calls.append(len(chunk))
        rows = len(chunk)
        prompts = torch.full((rows, PROMPT_LEN), 5, dtype=torch.int64)
        responses = torch.tensor([[20 + (i % 3), 21, 22, 0] for i in range(rows)], dtype=torch.int64)
        attention = torch.ones(rows, PROMPT_LEN + RESPONSE_LEN, dtype=torch.int64)
        attention[:, -1] = 0  # three response tokens: the score sits on the third
        rm_scores = torch.zeros(rows, RESPONSE_LEN)
        rm_scores[:, 2] = 0.5  # the recording's reward
        non_tensor = {
            "__num_turns__": np.full(rows, 2, dtype=np.int32),
            "acc": np.full(rows, 0.5),
            "reward_extra_info": np.array([{"acc": 0.5}] * rows, dtype=object),
            "raw_prompt": chunk.non_tensor_batch["raw_prompt"].copy(),
        }
        return DataProto.from_dict(
            tensors={
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], dim=1),
                "attention_mask": attention,
                "position_ids": torch.arange(PROMPT_LEN + RESPONSE_LEN).expand(rows, -1).clone(),
                "response_mask": attention[:, PROMPT_LEN:].clone(),
                "rm_scores": rm_scores,
            },
            non_tensors=non_tensor,
            meta_info={"metrics": [METRICS] * rows, "reward_extra_keys": ["acc"]},
        )


class FullyAsyncGenerator(Generator):
    """:class:`Generator` replying as the fully async manager awaits a worker (``ref.future()``)."""

    def __init__(self, calls: list[int]) -> None:
        super().__init__(calls)
        outer = self

        class Method:
            def remote(self, chunk: DataProto) -> Any:
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_result(outer.generate(chunk))
                return type("Ref", (), {"future": lambda self: future})()

        self.generate_sequences = Method()


def manager(config: Any, calls: list[int], *, reward_workers: bool = True, fully_async: bool = False) -> Any:
    mgr = object.__new__(FullyAsyncAgentLoopManager if fully_async else AgentLoopManager)
    worker = FullyAsyncGenerator if fully_async else Generator
    mgr.agent_loop_workers = [worker(calls), worker(calls)]
    mgr.config = config
    mgr.reward_loop_worker_handles = [InProcessHandle(RewardLoopWorker(config))] if reward_workers else None
    return mgr


def generation_batch(step: int) -> DataProto:
    rows = len(PROMPTS)
    batch = DataProto.from_dict(
        tensors={"dummy": torch.zeros(rows, 1)},
        non_tensors={
            "raw_prompt": np.fromiter(([{"role": "user", "content": p}] for p in PROMPTS), dtype=object, count=rows),
            "data_source": np.array(["toy"] * rows, dtype=object),
            "reward_model": np.array([{"ground_truth": p} for p in PROMPTS], dtype=object),
            "uid": np.array([f"u{step}-{i}" for i in range(rows)], dtype=object),
        },
    )
    gen_batch = RayPPOTrainer._get_gen_batch(None, batch)  # verl's own split
    gen_batch.meta_info["global_steps"] = step
    return gen_batch.repeat(repeat_times=N, interleave=True)


def decoded(assets: Any, out: DataProto) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir))
    valid = out.batch["attention_mask"][:, PROMPT_LEN:].sum(dim=1)
    return [
        tokenizer.decode(row[:n], skip_special_tokens=True)
        for row, n in zip(out.batch["responses"], valid, strict=True)
    ]


def record_then_replay(
    tmp_path: Path, first: Any, second: Any, *, steps: int = 1, **settings: Any
) -> tuple[Any, Any, Any]:
    """Run 1 records ``steps`` steps under config ``first``; run 2 replays them under ``second``."""
    calls: list[int] = []
    run = RoleRun("rollout", tmp_path, tuple(range(1, steps + 1)), **settings).start()
    recorded = [manager(first, calls).generate_sequences(generation_batch(s)) for s in range(1, steps + 1)]
    run.stop()
    generated = len(calls)
    run = RoleRun("rollout", tmp_path, tuple(range(1, steps + 1)), **settings).start()
    mgr = manager(second, calls)
    served = [mgr.generate_sequences(generation_batch(s)) for s in range(1, steps + 1)]
    assert len(calls) == generated, "run 2 never generates"
    return recorded, served, run


def step_meta(tmp_path: Path, step: int = 1) -> dict[str, Any]:
    layout = tmp_path / "exp_proj" / f"GBS4_N{N}_in{PROMPT_LEN}_out{RESPONSE_LEN}"
    return json.loads((layout / str(step) / "meta.json").read_text())


# -- the identity ----------------------------------------------------------------------------------


def test_the_identity_follows_the_reward_files_content_and_deciding_settings(assets: Any, tmp_path: Path):
    one = reward_file(tmp_path, "a.py", LENGTH_REWARD)
    moved = reward_file(tmp_path, "b.py", LENGTH_REWARD)
    other = reward_file(tmp_path, "c.py", WORD_REWARD)
    base = reward_identity(run_config(assets, one))
    assert base is not None and base["files"]["reward.custom_reward_function.path"]["path"] == str(one)
    assert reward_identity(run_config(assets, moved))["digest"] == base["digest"], "same content elsewhere: same reward"
    assert reward_identity(run_config(assets, one, **{"reward.num_workers": 3}))["digest"] == base["digest"]
    assert reward_identity(run_config(assets, other))["digest"] != base["digest"]
    changed = run_config(assets, one, **{"reward.custom_reward_function.name": "other_fn"})
    assert reward_identity(changed)["digest"] != base["digest"]
    kwargs = run_config(assets, one, **{"reward.reward_manager.name": "dapo"})
    assert reward_identity(kwargs)["digest"] != base["digest"]
    # verl < 0.8's top-level keys count as well
    legacy = OmegaConf.create({"custom_reward_function": {"path": str(one), "name": "compute_score"}})
    legacy_other = OmegaConf.create({"custom_reward_function": {"path": str(other), "name": "compute_score"}})
    assert reward_identity(legacy)["digest"] != reward_identity(legacy_other)["digest"]
    assert reward_identity(None) is None


@pytest.mark.parametrize(
    ("policy", "recorded", "rescored"),
    [
        ("auto", "same", False),
        ("auto", "other", True),
        ("auto", "none", True),
        ("always", "same", True),
        ("never", "other", False),
        ("never", "none", False),
    ],
)
def test_each_rule_of_rescore(assets: Any, tmp_path: Path, policy: str, recorded: str, rescored: bool):
    this = reward_identity(run_config(assets, reward_file(tmp_path, "a.py", LENGTH_REWARD)))
    other = reward_identity(run_config(assets, reward_file(tmp_path, "c.py", WORD_REWARD)))
    meta = {"same": {"reward": this}, "other": {"reward": other}, "none": {}}[recorded]
    decision = rescore.decide(RescorePolicy(policy), meta, this)
    assert decision.rescore is rescored
    assert decision.differs is (recorded != "same")
    if recorded == "none":
        assert "unknown reward" in decision.why
    if recorded == "other":
        assert "digest" in decision.why and "c.py" in decision.why


# -- on a hit, with verl's reward-loop worker --------------------------------------------------------


def test_a_step_records_its_reward_and_another_reward_rescores_the_served_rows(assets: Any, tmp_path: Path, caplog):
    TALLY.clear()
    first = run_config(assets, reward_file(tmp_path, "length.py", LENGTH_REWARD))
    second = run_config(assets, reward_file(tmp_path, "words.py", WORD_REWARD))
    with caplog.at_level(logging.INFO, logger="skipinject"):
        recorded, served, _ = record_then_replay(tmp_path / "dump", first, second)
    meta = step_meta(tmp_path / "dump")
    assert meta["reward"]["digest"] == reward_identity(first)["digest"]
    assert meta["reward"]["files"]["reward.custom_reward_function.path"]["path"].endswith("length.py")
    [out], [before] = served, recorded
    words = [len(text.split()) for text in decoded(assets, out)]
    # the score on the last response token, as verl's agent loop places it; extra infos are the new reward's
    assert torch.equal(out.batch["rm_scores"][:, 2], torch.tensor([10.0 * w for w in words]))
    assert float(out.batch["rm_scores"][:, [0, 1, 3]].abs().sum()) == 0.0
    assert out.meta_info["reward_extra_keys"] == ["score", "words"]
    assert "acc" not in out.non_tensor_batch and list(out.non_tensor_batch["words"]) == words
    assert [info["words"] for info in out.non_tensor_batch["reward_extra_info"]] == words
    assert torch.equal(out.batch["responses"], before.batch["responses"]), "the generation is replayed as recorded"
    assert out.meta_info["timing"]["skipinject/rescored_rows"] == len(out)
    assert out.meta_info["timing"]["skipinject/rescore_s"] > 0
    assert TALLY.roles["rollout"]["rescored_rows"] == len(out), "the run's summary counts them"
    lines = [r.getMessage() for r in caplog.records if "re-scored" in r.getMessage()]
    assert len(lines) == 1 and "rollout step 1: 8 rows re-scored by this run's reward-loop workers" in lines[0]
    assert "words.py" in lines[0] and "length.py" in lines[0]


def test_the_same_reward_serves_the_recording_bit_for_bit(assets: Any, tmp_path: Path, caplog):
    config = run_config(assets, reward_file(tmp_path, "length.py", LENGTH_REWARD))
    with caplog.at_level(logging.INFO, logger="skipinject"):
        [before], [out], _ = record_then_replay(tmp_path / "dump", config, config)
    for key in before.batch.keys():
        assert torch.equal(out.batch[key], before.batch[key]), key
    assert out.meta_info["reward_extra_keys"] == ["acc"] and list(out.non_tensor_batch["acc"]) == [0.5] * len(out)
    assert out.meta_info["timing"]["skipinject/rescored_rows"] == 0.0
    assert any("rewards served as recorded (recorded by this run's reward)" in r.getMessage() for r in caplog.records)


def test_always_rescores_with_the_same_reward(assets: Any, tmp_path: Path):
    config = run_config(assets, reward_file(tmp_path, "length.py", LENGTH_REWARD))
    _, [out], _ = record_then_replay(tmp_path / "dump", config, config, rescore="always")
    lengths = [float(len(text)) for text in decoded(assets, out)]
    assert out.batch["rm_scores"][:, 2].tolist() == lengths and list(out.non_tensor_batch["acc"]) == lengths


def test_never_serves_the_recorded_scores_and_says_so_once(assets: Any, tmp_path: Path, caplog):
    first = run_config(assets, reward_file(tmp_path, "length.py", LENGTH_REWARD))
    second = run_config(assets, reward_file(tmp_path, "words.py", WORD_REWARD))
    with caplog.at_level(logging.INFO, logger="skipinject"):
        recorded, served, _ = record_then_replay(tmp_path / "dump", first, second, steps=2, rescore="never")
    for before, out in zip(recorded, served, strict=True):
        assert torch.equal(out.batch["rm_scores"], before.batch["rm_scores"])
    warned = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "not computed by" in r.getMessage()
    ]
    assert len(warned) == 1 and "rescore=never" in warned[0]
    assert any("rollout step 2: rewards served as recorded" in r.getMessage() for r in caplog.records)


def test_a_cache_recording_no_reward_is_rescored_under_auto(assets: Any, tmp_path: Path, caplog):
    config = run_config(assets, reward_file(tmp_path, "length.py", LENGTH_REWARD))
    dump = tmp_path / "dump"
    calls: list[int] = []
    run = RoleRun("rollout", dump, (1,)).start()
    manager(config, calls).generate_sequences(generation_batch(1))
    run.stop()
    # a step written before identities were: its meta.json has no "reward" (the store's checksum kept valid)
    from skipinject.store import meta_digest

    meta_path = dump / "exp_proj" / f"GBS4_N{N}_in{PROMPT_LEN}_out{RESPONSE_LEN}" / "1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["reward"], meta["meta_checksum"]
    meta["meta_checksum"] = meta_digest(meta)
    meta_path.write_text(json.dumps(meta))
    run = RoleRun("rollout", dump, (1,)).start()
    with caplog.at_level(logging.INFO, logger="skipinject"):
        out = manager(config, calls).generate_sequences(generation_batch(1))
    assert len(calls) == 2, "served, not generated"
    assert out.batch["rm_scores"][:, 2].tolist() == [float(len(t)) for t in decoded(assets, out)]
    assert any("recorded by an unknown reward" in r.getMessage() for r in caplog.records)


def test_without_reward_loop_workers_the_trainer_scores(assets: Any, tmp_path: Path):
    """A manager holding no reward-loop workers (a colocated reward model; verl < 0.9): the recorded
    scores are taken out, as a generation that scored nothing leaves them, so the trainer scores."""
    first = run_config(assets, reward_file(tmp_path, "length.py", LENGTH_REWARD))
    second = run_config(assets, reward_file(tmp_path, "words.py", WORD_REWARD))
    dump = tmp_path / "dump"
    calls: list[int] = []
    run = RoleRun("rollout", dump, (1,)).start()
    manager(first, calls).generate_sequences(generation_batch(1))
    run.stop()
    RoleRun("rollout", dump, (1,)).start()
    out = manager(second, calls, reward_workers=False).generate_sequences(generation_batch(1))
    assert "rm_scores" not in out.batch.keys() and "acc" not in out.non_tensor_batch
    assert "reward_extra_keys" not in out.meta_info


def test_rows_of_one_source_are_rescored_and_the_others_kept(assets: Any, tmp_path: Path):
    """``action=match`` merges rows of several recordings: only those recorded by another reward change."""
    first = run_config(assets, reward_file(tmp_path, "length.py", LENGTH_REWARD))
    calls: list[int] = []
    mgr = manager(first, calls)
    batch = Generator(calls).generate(generation_batch(1))
    this = {"reward": reward_identity(first)}
    done = rescore.apply(
        batch, _call(mgr, generation_batch(1)), "rollout", 1, None, [(this, [0, 1, 2, 3]), ({}, [4, 5, 6, 7])]
    )
    assert done.rows == 4
    lengths = [float(len(t)) for t in decoded(assets, batch)]
    assert batch.batch["rm_scores"][:, 2].tolist() == [0.5] * 4 + lengths[4:]
    assert list(batch.non_tensor_batch["acc"]) == [0.5] * 4 + lengths[4:]


def fully_async_sample(index: int, prompt: str) -> DataProto:
    """What the fully async Rollouter hands ``generate_sequences_single``: one prompt, ``n`` rows."""
    rows = np.fromiter([[{"role": "user", "content": prompt}]] * N, dtype=object, count=N)
    return DataProto.from_dict(
        tensors={"dummy": torch.zeros(N, 1)},
        non_tensors={
            "raw_prompt": rows,
            "data_source": np.array(["toy"] * N, dtype=object),
            "reward_model": np.array([{"ground_truth": prompt}] * N, dtype=object),
            "uid": np.array([f"sample_0_{index}"] * N, dtype=object),
        },
    )


def test_fully_async_match_rescores_the_served_samples_rows(assets: Any, tmp_path: Path, caplog):
    """``async_rollout`` with ``action=match``: a sample whose prompt a recording of another reward generated is
    served with this run's scores; a sample it did not see is generated (scored by this run's reward already)."""
    first = run_config(assets, reward_file(tmp_path, "length.py", LENGTH_REWARD))
    second = run_config(assets, reward_file(tmp_path, "words.py", WORD_REWARD))
    dump, calls = tmp_path / "dump", []
    TALLY.clear()
    RoleRun("async_rollout", dump, (1, 2), action="match").start()
    recording = manager(first, calls, fully_async=True)
    recorded = [asyncio.run(recording.generate_sequences_single(fully_async_sample(i, PROMPTS[i]))) for i in (1, 2)]
    assert calls == [N, N]
    RoleRun("async_rollout", dump, (1, 2), action="match").start()
    replaying = manager(second, calls, fully_async=True)
    with caplog.at_level(logging.INFO, logger="skipinject"):
        served = asyncio.run(replaying.generate_sequences_single(fully_async_sample(1, PROMPTS[2])))
        generated = asyncio.run(replaying.generate_sequences_single(fully_async_sample(2, PROMPTS[3])))
    assert calls == [N, N, N], "the prompt run 1 generated (at feed index 2) is served at feed index 1"
    assert torch.equal(served.batch["responses"], recorded[1].batch["responses"])
    words = [len(text.split()) for text in decoded(assets, served)]
    assert served.batch["rm_scores"][:, 2].tolist() == [10.0 * w for w in words], "this run's reward, not 0.5"
    assert (
        served.meta_info["reward_extra_keys"] == ["score", "words"] and list(served.non_tensor_batch["words"]) == words
    )
    assert "timing" not in served.meta_info, (
        "nothing added: the fully async trainer asserts its samples' meta_info agree"
    )
    assert generated.batch["rm_scores"][:, 2].tolist() == [0.5] * N, "a generated sample keeps what its reward gave"
    lines = [r.getMessage() for r in caplog.records if "re-scored" in r.getMessage()]
    assert len(lines) == 1 and f"async_rollout step 1: {N} rows re-scored by this run's reward-loop workers" in lines[0]
    assert "words.py" in lines[0] and "length.py" in lines[0]
    assert TALLY.roles["async_rollout"]["rescored_rows"] == N, "the run's summary counts them"


def _call(instance: Any, batch: DataProto) -> Any:
    from skipinject import Call

    return Call("t", AgentLoopManager.generate_sequences, instance, (batch,), {})


def test_record_meta_without_a_run_config_records_nothing():
    from skipinject import Call

    assert record_reward(Call("t", len, None, (None,), {})) is None


@pytest.fixture(autouse=True)
def _stopped() -> Any:
    log = logging.getLogger("skipinject")
    level = log.level
    yield
    RoleRun.stop_all()  # a run still going restores the level it found (a capture's, maybe): put back ours
    log.setLevel(level)
    bootstrap.stop()
    os.environ.pop("SKIPINJECT_CONFIG", None)


# -- V1 trajectories (TransferQueue's fields), as rollout_tq serves them --------------------------


def trajectories(rows: int) -> Any:
    """V1 trajectories as ``AgentLoopWorkerTQ._agent_loop_postprocess`` puts them (verl's own conversion)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    fields = []
    for row in range(rows):
        response = torch.tensor([20 + row % 3, 21, 22][: 2 + row % 2], dtype=torch.int64)
        prompt = torch.full((3 + row % 2,), 5, dtype=torch.int64)
        scores = torch.zeros(len(response))
        scores[-1] = 0.5
        fields.append(
            {
                "prompts": prompt,
                "responses": response,
                "response_mask": torch.ones_like(response),
                "input_ids": torch.cat([prompt, response]),
                "rm_scores": scores,
                "num_turns": 2,
                "extra_fields": {"reward_extra_info": {"acc": 0.5}, "turn_scores": []},
                "data_source": "toy",
                "reward_model": {"ground_truth": "x"},
                "uid": f"u{row // N}",
            }
        )
    return list_of_dict_to_tensordict(fields)


def test_v1_trajectories_are_rescored_by_this_runs_reward_loop_worker(assets: Any, tmp_path: Path, caplog):
    from transformers import AutoTokenizer

    first = run_config(assets, reward_file(tmp_path, "length.py", LENGTH_REWARD))
    second = run_config(assets, reward_file(tmp_path, "words.py", WORD_REWARD))
    workers = [InProcessHandle(RewardLoopWorker(second))]
    from verl.utils.tensordict_utils import index_select_tensor_dict

    fields = index_select_tensor_dict(trajectories(4), [0, 1, 2, 3])  # as rollout_tq's remap selects them
    responses = [r.clone() for r in fields["responses"].unbind(0)]
    TALLY.clear()
    with caplog.at_level(logging.INFO, logger="skipinject"):
        done = rescore.apply_trajectories(
            fields, workers, reward_identity(second), "rollout_tq", 1, None, record_reward_meta(first)
        )
    assert done.rows == 4
    tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir))
    words = [len(tokenizer.decode(r, skip_special_tokens=True).split()) for r in responses]
    scores = list(fields["rm_scores"].unbind(0))
    assert [float(s[-1]) for s in scores] == [10.0 * w for w in words]
    assert all(float(s[:-1].abs().sum()) == 0.0 and len(s) == len(r) for s, r in zip(scores, responses, strict=True))
    extras = list(fields["extra_fields"])
    assert [e["reward_extra_info"] for e in extras] == [{"score": 10.0 * w, "words": w} for w in words]
    assert all(e["turn_scores"] == [] for e in extras), "the trajectory's other extra fields are kept"
    assert any("rollout_tq step 1: 4 rows re-scored" in r.getMessage() for r in caplog.records)
    # the same reward: nothing touched
    again = trajectories(4)
    same = rescore.apply_trajectories(
        again, workers, reward_identity(second), "rollout_tq", 1, None, record_reward_meta(second)
    )
    assert same.rows == 0 and [float(s[-1]) for s in again["rm_scores"].unbind(0)] == [0.5] * 4
    assert TALLY.roles["rollout_tq"]["rescored_rows"] == 4, "the run's summary counts them"


def record_reward_meta(config: Any) -> dict[str, Any]:
    return {"reward": reward_identity(config)}
