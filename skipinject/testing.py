"""A test kit for roles (plugin API 1.1): run a role in this process, call its target, assert hit or miss
(docs/plugins.md). Without verl: :class:`ToyTrainer`, :func:`toy_batch`, :func:`same_batch`, :class:`IntCodec`;
with verl's V0 trainer: :func:`v0_trainer`, :func:`v0_run_config`, :func:`grpo_batch`."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from skipinject import bootstrap
from skipinject.config import Config
from skipinject.config.overrides import apply_overrides, split_overrides
from skipinject.errors import CodecError, ConfigError
from skipinject.payload import Payload
from skipinject.roles import Call, Role, TargetPath

if TYPE_CHECKING:
    from skipinject.engine import Engine
    from skipinject.plugin_manager import PluginSet

__all__ = [
    "IntCodec",
    "RoleRun",
    "ToyTrainer",
    "call",
    "grpo_batch",
    "resolve",
    "same_batch",
    "toy_batch",
    "v0_run_config",
    "v0_trainer",
]

_LOG = logging.getLogger("skipinject")


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class RoleRun:
    """One run of ``roles`` (names, comma-separated, or :class:`~skipinject.Role` objects) in this process,
    its settings checked as the runner does; keeps the run's log lines. ``plugins``: default the role names."""

    #: The runs started and not stopped (one at most: starting one stops the others).
    _running: ClassVar[list[RoleRun]] = []

    def __init__(
        self,
        roles: str | Role | Sequence[Role],
        dump_dir: str | Path,
        steps: str | Iterable[int] = "[1,2]",
        *overrides: str,
        plugins: str | None = None,
        **settings: Any,
    ) -> None:
        from skipinject.plugin_manager import LoadedPlugin, PluginSet, SkipPluginManager, load_plugins

        if isinstance(roles, str):
            self.roles = [name.strip() for name in roles.split(",") if name.strip()]
            selection = plugins if plugins is not None else roles
            self.plugins: PluginSet = load_plugins(selection)
        else:
            given = [roles] if isinstance(roles, Role) else list(roles)
            self.roles = [role.name for role in given]
            selection = None
            self.plugins = PluginSet(SkipPluginManager(), [LoadedPlugin("test", __name__, None, roles=given)])
        if not isinstance(steps, str):
            steps = "[" + ",".join(str(int(step)) for step in steps) + "]"
        settings = {"enable": True, "steps": steps, "dump_dir": dump_dir, **settings}
        argv = [f"skip.{name}.{key}={value}" for name in self.roles for key, value in settings.items()]
        parsed, rest = split_overrides([*argv, *overrides])
        if rest:
            raise ConfigError(f"{rest[0]}: not a skip.<role>.<key>=<value> override")
        resolved = apply_overrides(Config(), parsed, self.plugins.roles)
        self.config = Config(plugins=selection, roles=resolved.roles)
        #: The ``skipinject`` log lines of the run (kept after it stopped).
        self.lines: list[str] = []
        self.engine: Engine | None = None
        self._handler = _Lines(self.lines)
        self._level = logging.NOTSET

    def start(self) -> RoleRun:
        """Start the engine (after stopping any other run of this process); logs are collected from here."""
        RoleRun.stop_all()
        bootstrap.stop()
        RoleRun._running.append(self)
        self._level = _LOG.level
        _LOG.addHandler(self._handler)
        _LOG.setLevel(logging.INFO)
        self.engine = bootstrap.start(self.config, self.plugins)
        if self.engine is None or not set(self.roles) <= set(self.engine.runtimes):
            self.stop()
            raise RuntimeError(f"skipinject did not start {self.roles} (SKIPINJECT_DISABLE set?)")
        return self

    def stop(self) -> None:
        """End the run: open steps committed, patches undone, log collection stopped (once)."""
        if self not in RoleRun._running:
            return
        try:
            bootstrap.stop()
        finally:
            RoleRun._running.remove(self)
            _LOG.removeHandler(self._handler)
            _LOG.setLevel(self._level)
            self.engine = None

    @classmethod
    def stop_all(cls) -> None:
        """Stop every run still going (for a test's teardown: a run started without ``with``)."""
        for run in list(cls._running):
            run.stop()

    def __enter__(self) -> RoleRun:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def lines_with(self, needle: str) -> list[str]:
        return [line for line in self.lines if needle in line]

    def _decisions(self, what: str, step: int | None, role: str | None) -> list[str]:
        if role is None and len(self.roles) != 1:
            raise ValueError(f"this run has roles {self.roles}: name the one to look at")
        number = r"\d+" if step is None else str(step)
        pattern = re.compile(rf"{re.escape(role or self.roles[0])} step {number}: {what}")
        return [line for line in self.lines if pattern.match(line)]

    def hits(self, step: int | None = None, role: str | None = None) -> list[str]:
        """The run's hit lines (of ``step``), e.g. ``judge step 1: hit, served step 1 (own cache) ...``."""
        return self._decisions("hit", step, role)

    def misses(self, step: int | None = None, role: str | None = None) -> list[str]:
        """The run's miss lines (of ``step``): the target ran and its result is saved."""
        return self._decisions(r"miss \(", step, role)

    def assert_hit(self, step: int, served: int | None = None, role: str | None = None) -> str:
        """The run served ``step`` from the cache (of step ``served``, default ``step``); its line."""
        wanted = f"served step {step if served is None else served} "
        found = [line for line in self.hits(step, role) if wanted in line]
        assert found, f"no hit of step {step} ({wanted.strip()}) in the run's log:\n" + "\n".join(self.lines)
        return found[0]

    def assert_miss(self, step: int, role: str | None = None) -> str:
        """The run ran the target at ``step`` (nothing cached) and saved it; the miss line."""
        found = self.misses(step, role)
        assert found, f"no miss of step {step} in the run's log:\n" + "\n".join(self.lines)
        assert not self.hits(step, role), f"step {step} was also served: {self.hits(step, role)}"
        return found[0]


def resolve(target: str) -> Any:
    """The callable named ``package.module:Qualified.name``, looked up now (patched or not)."""
    path = TargetPath.parse(target)
    return functools.reduce(getattr, path.qualname.split("."), importlib.import_module(path.module))


def call(target: str, *args: Any, **kwargs: Any) -> Any:
    """Call the target ``package.module:function`` as its caller would: looked up where it lives, now."""
    return resolve(target)(*args, **kwargs)


class IntCodec:
    """The codec of a target that returns an ``int``."""

    def encode(self, result: int) -> Payload:
        return Payload(objects={"value": int(result)}, rows=1)

    def decode(self, payload: Payload, call: Call) -> int:
        value = payload.objects.get("value")
        if not isinstance(value, int):
            raise CodecError("no value")
        return value


class ToyTrainer:
    """A trainer as a role sees it: ``global_steps`` and a ``config`` naming the cache directory; :meth:`fit`
    calls the test's :meth:`generate` ``calls.get(step, 1)`` times per step, into ``outputs``."""

    def __init__(
        self,
        global_steps: int = 0,
        *,
        experiment: str = "e",
        project: str = "p",
        train_batch_size: int = 4,
        n: int = 2,
        prompt_length: int = 8,
        response_length: int = 8,
        calls: dict[int, int] | None = None,
    ) -> None:
        self.global_steps = global_steps
        self.config = _run_config(experiment, project, train_batch_size, n, prompt_length, response_length)
        self.calls = dict(calls or {})
        self.outputs: list[Any] = []

    def fit(self, steps: int | Iterable[int] = ()) -> list[Any]:
        """Steps ``1..steps`` (or the step numbers given); each calls :meth:`generate` with the call's number."""
        for step in range(1, steps + 1) if isinstance(steps, int) else steps:
            self.global_steps = step
            for _ in range(self.calls.get(step, 1)):
                self.outputs.append(self.generate(len(self.outputs)))
        return self.outputs

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a ToyTrainer's generate is the test's: subclass it or patch it")


def toy_batch(rows: int = 4, width: int = 8, *, seed: int = 0, step: int = 1) -> dict[str, Any]:
    """A rollout result shaped like verl's ``DataProto`` (``batch``, ``non_tensor_batch``, ``meta_info``)."""
    import numpy as np
    import torch
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "input_ids": torch.randint(0, 32000, (rows, 2 * width), generator=gen),
        "attention_mask": torch.ones(rows, 2 * width, dtype=torch.int64),
        "responses": torch.randint(0, 32000, (rows, width), generator=gen),
        "rollout_log_probs": torch.randn(rows, width, generator=gen),
    }
    prompts = [[{"role": "user", "content": f"question {seed}-{i // 2}"}] for i in range(rows)]
    non_tensor = {
        "uid": np.fromiter((f"uid-{seed}-{i // 2}" for i in range(rows)), dtype=object, count=rows),
        "raw_prompt": np.fromiter(prompts, dtype=object, count=rows),
        "data_source": np.fromiter(("gsm8k" for _ in range(rows)), dtype=object, count=rows),
        "reward_model": np.fromiter(({"ground_truth": str(i)} for i in range(rows)), dtype=object, count=rows),
    }
    return {
        "batch": TensorDict(tensors, batch_size=[rows]),
        "non_tensor_batch": non_tensor,
        "meta_info": {"global_steps": step, "seed": seed},
    }


def same_batch(a: Any, b: Any) -> bool:
    """Two batches (:func:`toy_batch`'s or ``DataProto``) hold the same data (``meta_info`` but its ``timing``)."""
    import torch

    def parts(batch: Any) -> tuple[Any, Any, Any]:
        if isinstance(batch, dict):
            return batch["batch"], batch["non_tensor_batch"], batch["meta_info"]
        return batch.batch, batch.non_tensor_batch, batch.meta_info

    (tensors_a, rows_a, meta_a), (tensors_b, rows_b, meta_b) = parts(a), parts(b)
    if sorted(tensors_a.keys()) != sorted(tensors_b.keys()):
        return False
    if any(not torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a.keys()):
        return False
    if sorted(rows_a) != sorted(rows_b) or any(list(rows_a[k]) != list(rows_b[k]) for k in rows_a):
        return False
    return {k: v for k, v in meta_a.items() if k != "timing"} == {k: v for k, v in meta_b.items() if k != "timing"}


def v0_run_config(
    *, train_batch_size: int = 4, n: int = 2, prompt_length: int = 5, response_length: int = 6, **sections: Any
) -> Any:
    """A V0 trainer config (OmegaConf) naming the cache directory ``e_p/GBS{gbs}_N{n}_in{p}_out{r}``."""
    from omegaconf import OmegaConf

    config = _run_config("e", "p", train_batch_size, n, prompt_length, response_length)
    config["trainer"]["use_v1"] = False
    config["algorithm"] = {"adv_estimator": "grpo", "use_pf_ppo": False}
    config.update(sections)
    return OmegaConf.create(config)


def _run_config(experiment: str, project: str, gbs: int, n: int, prompt: int, response: int) -> dict[str, Any]:
    """verl's config sections that name the cache directory ``{experiment}_{project}/GBS{gbs}_N{n}_in..``."""
    return {
        "trainer": {"experiment_name": experiment, "project_name": project},
        "data": {"train_batch_size": gbs, "max_prompt_length": prompt, "max_response_length": response},
        "actor_rollout_ref": dict(rollout={"n": n}),  # verl's section (not the role of that name)
    }


class _StopFit(Exception):
    """Raised by the first thing ``RayPPOTrainer.fit`` touches: ``fit`` entered, and left at once."""


class _Executor:
    @property
    def _shutdown(self) -> bool:
        raise _StopFit


def v0_trainer(global_steps: int, config: Any = None) -> Any:
    """A real ``RayPPOTrainer`` at ``global_steps`` that entered the patched ``fit`` (the clock) and left it."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = v0_run_config() if config is None else config
    trainer._dump_executor = _Executor()
    with contextlib.suppress(_StopFit):
        trainer.fit()
        raise AssertionError("RayPPOTrainer.fit did not stop at its first line: another verl?")
    trainer.global_steps = global_steps
    return trainer


def grpo_batch(
    seed: int = 0, prompts: int = 4, n: int = 2, prompt_len: int = 5, response_len: int = 6, *, scores: Any = None
) -> Any:
    """A V0 GRPO batch (``DataProto``) as ``fit`` has it after the rollout; ``scores`` (per row, ``True``:
    random) add the reward loop's ``rm_scores`` and ``acc``."""
    import uuid

    import numpy as np
    import torch
    from verl import DataProto

    gen = torch.Generator().manual_seed(seed)
    rows = prompts * n
    lengths = torch.randint(1, response_len + 1, (rows,), generator=gen)

    def at_last_token(values: Any) -> Any:
        placed = torch.zeros(rows, response_len)
        placed[torch.arange(rows), lengths - 1] = values
        return placed

    response_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).long()
    prompt_ids = torch.randint(3, 400, (prompts, prompt_len), generator=gen).repeat_interleave(n, dim=0)
    responses = torch.randint(3, 400, (rows, response_len), generator=gen) * response_mask
    token_level_rewards = at_last_token(torch.rand(rows, generator=gen))
    uids = np.repeat(np.array([str(uuid.uuid4()) for _ in range(prompts)], dtype=object), n)
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([torch.ones(rows, prompt_len, dtype=torch.long), response_mask], dim=1),
            "response_mask": response_mask,
            "token_level_scores": token_level_rewards.clone(),
            "token_level_rewards": token_level_rewards,
        },
        non_tensors={"uid": uids, "data_source": np.array(["toy"] * rows, dtype=object)},
        meta_info={"global_token_num": [prompt_len] * rows},
    )
    if scores is None or scores is False:
        return batch
    if scores is True:
        scores = torch.rand(rows, generator=torch.Generator().manual_seed(100 + seed))
    batch.batch["rm_scores"] = at_last_token(scores)
    batch.non_tensor_batch["acc"] = np.array((scores > 0.5).tolist())
    batch.non_tensor_batch["reward_model"] = np.array(
        [{"style": "rule", "ground_truth": str(i % 4)} for i in range(rows)], dtype=object
    )
    batch.meta_info["reward_extra_keys"] = ["acc"]
    return batch
