"""Run the real verl trainers (0.9.1; V0 also on 0.8.0 and 0.7.1) for a few GRPO steps on a CPU-only machine.

Everything a test needs is here: tiny local assets (model, tokenizer, data, reward),
the Hydra overrides, the environment that loads :mod:`verl_cpu_shim` in every verl
process, thin launchers that capture the output, and readers for the generation log::

    from harness import build_assets, main_ppo_overrides, run_main_ppo, count_generate_calls

    assets = build_assets(Path("/tmp/verl_cpu_assets"))
    gen_log = Path("/tmp/gen.jsonl")
    proc = run_main_ppo(assets, main_ppo_overrides(assets, use_v1=False, total_steps=3), gen_log=gen_log)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(count_generate_calls(gen_log))

The launcher is a parameter so a wrapper such as ``python -m skipinject -m
verl.trainer.main_ppo`` can be put in front of the same overrides. From a shell::

    python examples/verl_cpu/harness.py --mode v0 --steps 3 --workdir /tmp/vc
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ASYNC_LAUNCHER",
    "MAIN_PPO_LAUNCHER",
    "MODES",
    "ONE_STEP_OFF_LAUNCHER",
    "ROLLOUT_N",
    "TRAIN_BATCH",
    "V1_MODES",
    "Assets",
    "build_assets",
    "cache_dir",
    "count_generate_calls",
    "count_server_starts",
    "fully_async_overrides",
    "gen_log_events",
    "generate_calls",
    "harness_env",
    "main_ppo_overrides",
    "mode_overrides",
    "one_step_off_overrides",
    "run_fully_async",
    "run_main_ppo",
    "skip_role",
    "verl_version",
    "weight_syncs",
]

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
ASSETS_VERSION = "1"
V1_MODES = ("sync", "separate_async", "colocate_async")
#: Modes of the command line / :func:`mode_overrides`.
MODES = ("v0", "v1", "v1-separate", "v1-colocate", "fully-async")
MAIN_PPO_LAUNCHER: tuple[str, ...] = (sys.executable, "-m", "verl.trainer.main_ppo")
ASYNC_LAUNCHER: tuple[str, ...] = (
    sys.executable,
    "-m",
    "verl.experimental.fully_async_policy.fully_async_main",
)

# Prompt/response budget and batch shape shared by every run (they also name the
# skip caches: GBS{gbs}_N{n}_in{PROMPT_LEN}_out{RESPONSE_LEN}).
PROMPT_LEN = 32
RESPONSE_LEN = 16
TRAIN_BATCH = 4
#: verl's one-step-off trainer: generation of step k+1 overlaps training of step k, on its own fake GPU.
ONE_STEP_OFF_LAUNCHER: tuple[str, ...] = (sys.executable, "-m", "verl.experimental.one_step_off_policy.main_ppo")
ROLLOUT_N = 2
N_ROWS = 32

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "one two three four five six seven eight nine ten count add sum the a of is what "
    "please answer short long number word letter cat dog sun moon red blue green yes no"
)
_REWARD_SOURCE = '''"""Toy reward for the CPU harness: longer answers score higher, capped at 1."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Return len(solution_str) / 40 clipped to [0, 1]."""
    return min(len(solution_str) / 40.0, 1.0)
'''


@dataclass(frozen=True)
class Assets:
    """Paths of the locally built model, data and reward function."""

    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    reward_file: Path


def _assets_at(root: Path) -> Assets:
    return Assets(
        root=root,
        model_dir=root / "model",
        train_file=root / "data" / "train.parquet",
        val_file=root / "data" / "val.parquet",
        reward_file=root / "reward.py",
    )


def _prompts(count: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    words = _WORDS.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(count)]


def _build_tokenizer(model_dir: Path) -> int:
    """Train a byte-level BPE on a tiny corpus and save it as a HF fast tokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _prompts(500, seed=1) + ["user assistant system"] * 10
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(model_dir)
    return len(fast)


def _build_model(model_dir: Path, vocab_size: int) -> None:
    """Save a randomly initialised Qwen2 of about 100k parameters."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(model_dir)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(model_dir)


def _build_data(train_file: Path, val_file: Path) -> None:
    import pandas as pd

    for path, seed in ((train_file, 2), (val_file, 3)):
        rows = [
            {
                "data_source": "toy_length",
                "prompt": [{"role": "user", "content": text}],
                "ability": "toy",
                "reward_model": {"style": "rule", "ground_truth": str(len(text))},
                "extra_info": {"index": i, "split": path.stem},
            }
            for i, text in enumerate(_prompts(N_ROWS, seed=seed))
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_assets(root: Path) -> Assets:
    """Build the tiny model, tokenizer, 32-row train/val parquet and reward file under ``root``.

    Idempotent and safe to call from several processes at once: the build holds a file
    lock, and a version stamp written last makes later calls return at once. A directory
    without the current stamp (partly built, or by an older harness) is rebuilt in place.
    Takes a few seconds; needs no network.
    """
    root = Path(root).resolve()
    assets = _assets_at(root)
    marker = root / ".assets_version"

    def current() -> bool:
        return marker.is_file() and marker.read_text().strip() == ASSETS_VERSION

    if current():
        return assets
    with _locked(root / ".assets_lock"):
        if current():
            return assets
        start = time.monotonic()
        marker.unlink(missing_ok=True)
        assets.model_dir.mkdir(parents=True, exist_ok=True)
        _build_model(assets.model_dir, vocab_size=_build_tokenizer(assets.model_dir))
        _build_data(assets.train_file, assets.val_file)
        assets.reward_file.write_text(_REWARD_SOURCE)
        marker.write_text(ASSETS_VERSION + "\n")
        logger.info("built CPU harness assets in %s (%.1fs)", root, time.monotonic() - start)
    return assets


# -- configuration -----------------------------------------------------------------------


def skip_role(*, use_v1: bool = False, fully_async: bool = False) -> str:
    """The skip role that can fire in a trainer: ``rollout`` (V0), ``rollout_tq`` (V1), ``async_rollout``."""
    if fully_async:
        return "async_rollout"
    return "rollout_tq" if use_v1 else "rollout"


def cache_dir(dump_dir: Path, *, experiment: str = "e", project: str = "p", gbs: int = TRAIN_BATCH) -> Path:
    """Where a skip cache of a harness run lives: ``{dump_dir}/{experiment}_{project}/GBS.._N.._in.._out..``.

    ``gbs`` is ``data.gen_batch_size`` if set, else ``data.train_batch_size``: 4 for V0 and V1
    ``sync``, 1 for the asynchronous modes (they feed one prompt at a time).
    """
    name = f"GBS{gbs}_N{ROLLOUT_N}_in{PROMPT_LEN}_out{RESPONSE_LEN}"
    return Path(dump_dir) / f"{experiment}_{project}" / name


def verl_version(python: str | os.PathLike[str] | None = None) -> str:
    """The verl version installed for ``python`` (default: this interpreter), e.g. ``"0.9.1"``."""
    if python is None or Path(python) == Path(sys.executable):
        from importlib.metadata import version

        return version("verl")
    code = "from importlib.metadata import version; print(version('verl'))"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _release(version: str) -> tuple[int, ...]:
    """``"0.9.1"`` -> ``(0, 9, 1)`` (pre/dev/local suffixes ignored: a dev build counts as its release)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def has_use_v1(version: str) -> bool:
    """verl >= 0.9 has ``trainer.use_v1``; older ones reject the key (``not in struct``)."""
    return _release(version) >= (0, 9)


def _version_overrides(version: str, rollout_mode: str | None = None) -> list[str]:
    """What a verl older than 0.9 needs on top of the common overrides (examples/verl_cpu/README.md says why).

    * Before 0.8 the V0 trainer runs verl's legacy FSDP workers: FSDP1 refuses CPU parameters,
      so ``fsdp_config.strategy=fsdp2`` for actor and reference; their auto-wrap policy finds no
      layer class in transformers 5's Qwen2, so it is named.
    * Before 0.7 the trainer's default ``rollout.mode`` is ``sync`` (worker-group generation); the
      harness picks ``async`` on 0.6 unless ``rollout_mode="sync"`` is asked for (then the
      shim's sync ``hf`` rollout generates in the worker). ``async`` goes through the agent loop
      and the shim's ``hf`` server, and needs ``data.return_raw_chat=True``.
    """
    release = _release(version)
    if release >= (0, 8):
        return []
    # fsdp_config.strategy exists from 0.6 on (0.4/0.5: actor.strategy, which the reference follows).
    keys = [("", "strategy=fsdp2")] if release >= (0, 6) else []
    keys.append(("+", "wrap_policy.transformer_layer_cls_to_wrap=[Qwen2DecoderLayer]"))
    overrides = [
        f"{prefix}actor_rollout_ref.{worker}.fsdp_config.{key}" for worker in ("actor", "ref") for prefix, key in keys
    ]
    default_mode = "async" if release >= (0, 6) else "sync"  # 0.4/0.5: verl's own HFRollout, no agent loop
    if release < (0, 7) and (rollout_mode or default_mode) == "async":
        # The agent loop reads the chat messages (``raw_prompt``), which 0.6's dataset returns only when asked.
        overrides += ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=True"]
    elif release < (0, 7):
        overrides += ["actor_rollout_ref.rollout.mode=sync"]
    return overrides


def _reward_overrides(assets: Assets, version: str) -> list[str]:
    """The toy reward function: under ``reward.`` from verl 0.7 on, top-level before.

    (0.7 and 0.8 still have a top-level ``custom_reward_function``, deprecated, whose ``name``
    defaults to null: setting its path there breaks the reward workers.)
    """
    if _release(version) >= (0, 7):
        return [f"reward.custom_reward_function.path={assets.reward_file}"]
    return [f"custom_reward_function.path={assets.reward_file}"]


def _common_overrides(
    assets: Assets, *, experiment: str, project: str, version: str | None = None, rollout_mode: str | None = None
) -> list[str]:
    """Overrides every CPU run needs, whatever the trainer (examples/verl_cpu/README.md says why each is there)."""
    version = version or verl_version()
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={assets.train_file}",
        f"data.val_files={assets.val_file}",
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={RESPONSE_LEN}",
        # verl 0.4 reads the key with a default of 8 but has none in its schema: added there.
        f"{'' if _release(version) >= (0, 5) else '+'}data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        # The agent loop's workers (verl 0.5 on; 0.4 has no agent loop).
        *(["actor_rollout_ref.rollout.agent.num_workers=1"] if _release(version) >= (0, 5) else []),
        # The reward loop's workers (verl 0.8 on; default 8): each is a Ray actor process importing verl
        # and torch at start-up, most of a minute of the 2 cores per run for 8 rows a step.
        *(["reward.num_workers=1"] if _release(version) >= (0, 8) else []),
        *_reward_overrides(assets, version),
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=False",
        "trainer.logger=[console]",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"trainer.project_name={project}",
        f"trainer.experiment_name={experiment}",
        *_version_overrides(version, rollout_mode),
    ]


def _ray_overrides(fake_gpus: int, version: str | None = None) -> list[str]:
    """Local Ray: enough logical CPUs for verl's actors and ``fake_gpus`` fake GPU resources.

    verl's actors each reserve logical CPUs (TransferQueue alone asks one per storage unit),
    which the 2 real cores could never satisfy; the numbers are only for Ray's scheduler.
    ``++`` because ``num_gpus`` is in verl's schema only for some entry points. verl 0.4/0.5 read
    a top-level ``ray_init`` and pass no ``num_gpus`` (the shim adds ``VERL_CPU_FAKE_GPUS``).
    No dashboard: nothing reads it, and its ten processes cost a few seconds of the 2 cores per run.
    """
    if version is not None and _release(version) < (0, 6):
        return [f"ray_init.num_cpus={16 if fake_gpus == 1 else 32}"]
    return [
        f"ray_kwargs.ray_init.num_cpus={16 if fake_gpus == 1 else 32}",
        f"++ray_kwargs.ray_init.num_gpus={fake_gpus}",
        "++ray_kwargs.ray_init.include_dashboard=False",
    ]


def _batch_overrides(mini_batch: int) -> list[str]:
    """PPO mini-batch of ``mini_batch`` prompts; micro-batches of one whole mini-batch (n sequences each).

    verl asserts that the sequences a log-prob pass gets divide by the micro-batch size; in
    ``separate_async`` one pass gets one mini-batch, so a micro-batch of the train batch fails.
    """
    micro = mini_batch * ROLLOUT_N
    return [
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
    ]


def _skip_dump_dir(role: str, dump_dir: Path | str | None) -> list[str]:
    if dump_dir is None:
        return []
    if isinstance(dump_dir, str) and "://" in dump_dir:  # a remote store's URL (s3://...): as given
        return [f"skip.{role}.dump_dir={dump_dir}"]
    return [f"skip.{role}.dump_dir={Path(dump_dir).resolve()}"]


def main_ppo_overrides(
    assets: Assets,
    *,
    use_v1: bool,
    total_steps: int,
    trainer_mode: str = "sync",
    parameter_sync_step: int = 1,
    dump_dir: Path | str | None = None,
    experiment: str = "e",
    project: str = "p",
    extra: Sequence[str] = (),
    verl: str | None = None,
    rollout_mode: str | None = None,
) -> list[str]:
    """Hydra overrides for ``verl.trainer.main_ppo``: a ``total_steps``-step GRPO run on CPU.

    * ``use_v1=False``: the V0 ``RayPPOTrainer`` (``trainer_mode`` must stay ``sync``).
    * ``use_v1=True``: the TransferQueue trainer in ``trainer_mode`` -- ``sync``,
      ``colocate_async`` or ``separate_async``. ``separate_async`` runs its rollout on a
      second fake GPU and syncs weights through the shim's ``cpu_store`` checkpoint engine
      every ``parameter_sync_step`` mini-batches (1, 2 or 4: verl needs
      ``train_batch_size == parameter_sync_step * ppo_mini_batch_size``, and the batch is 4).
    * ``dump_dir``: if given, ``skip.<role>.dump_dir`` for the role that can fire in this
      trainer (``rollout`` for V0, ``rollout_tq`` for V1; see :func:`skip_role`); enabling
      the role and its steps go in ``extra``. The cache then lands in
      :func:`cache_dir` ``(dump_dir, experiment=..., project=...)``.
    * ``experiment`` / ``project``: ``trainer.experiment_name`` / ``trainer.project_name``.
    * ``extra`` is appended last, so it wins over the defaults (Hydra: last one wins).
    * ``verl``: the verl version the launcher runs (default: the one installed for this
      interpreter, :func:`verl_version`). verl < 0.9 has no ``trainer.use_v1`` (and no V1
      trainer): the key is left out, and ``use_v1=True`` is an error.
    * ``rollout_mode``: ``actor_rollout_ref.rollout.mode`` on verl < 0.7 (``sync``: the worker
      group generates, through the shim's sync ``hf`` rollout on 0.6 and verl's own ``HFRollout``
      before; default ``async`` on 0.6, ``sync`` before); newer verls have only the agent loop.
    """
    verl = verl or verl_version()
    if rollout_mode not in (None, "sync", "async"):
        raise ValueError(f"rollout_mode must be 'sync' or 'async', not {rollout_mode!r}")
    if rollout_mode == "sync" and _release(verl) >= (0, 7):
        raise ValueError(f"verl {verl} has no sync rollout mode (actor_rollout_ref.rollout.mode=sync ends with 0.6)")
    if use_v1 and not has_use_v1(verl):
        raise ValueError(f"verl {verl} has no V1 trainer (trainer.use_v1 exists from verl 0.9 on)")
    if trainer_mode not in V1_MODES:
        raise ValueError(f"trainer_mode must be one of {V1_MODES}, not {trainer_mode!r}")
    if not use_v1 and trainer_mode != "sync":
        raise ValueError(f"trainer_mode={trainer_mode!r} needs use_v1=True (V0 only has the sync trainer)")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, not {total_steps}")
    if parameter_sync_step != 1 and trainer_mode != "separate_async":
        raise ValueError("parameter_sync_step applies to trainer_mode='separate_async' only")
    if parameter_sync_step < 1 or TRAIN_BATCH % parameter_sync_step:
        raise ValueError(f"parameter_sync_step must divide the train batch {TRAIN_BATCH}")

    overrides = _common_overrides(
        assets, experiment=experiment, project=project, version=verl, rollout_mode=rollout_mode
    )
    overrides += [
        f"data.train_batch_size={TRAIN_BATCH}",
        f"trainer.total_training_steps={total_steps}",
        *([f"trainer.use_v1={use_v1}"] if has_use_v1(verl) else []),
        *_batch_overrides(TRAIN_BATCH // parameter_sync_step),
    ]
    fake_gpus = 1
    if use_v1:
        overrides += [
            f"trainer.v1.trainer_mode={trainer_mode}",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        ]
    if trainer_mode == "separate_async":
        fake_gpus = 2
        overrides += [
            f"trainer.v1.separate_async.parameter_sync_step={parameter_sync_step}",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_store",
        ]
    overrides += _ray_overrides(fake_gpus, verl)
    overrides += _skip_dump_dir(skip_role(use_v1=use_v1), dump_dir)
    return overrides + list(extra)


def fully_async_overrides(
    assets: Assets,
    *,
    total_rollout_steps: int = 4,
    ppo_mini_batch_size: int = 2,
    dump_dir: Path | str | None = None,
    experiment: str = "e",
    project: str = "p",
    extra: Sequence[str] = (),
) -> list[str]:
    """Hydra overrides for ``fully_async_main``: one trainer fake GPU, one standalone rollout fake GPU.

    The Rollouter feeds one prompt at a time (``gen_batch_size=1``, ``n`` sequences each)
    and stops after ``total_rollout_steps`` prompts; the trainer takes ``ppo_mini_batch_size``
    prompt groups per step and syncs weights (``cpu_store``) after every step, so it runs
    ``total_rollout_steps // ppo_mini_batch_size`` steps (2 with the defaults).
    ``dump_dir`` sets ``skip.async_rollout.dump_dir``; the rest as in :func:`main_ppo_overrides`.
    """
    if total_rollout_steps < ppo_mini_batch_size:
        raise ValueError("total_rollout_steps must be >= ppo_mini_batch_size (else 0 trainer steps)")
    overrides = _common_overrides(assets, experiment=experiment, project=project)
    overrides += [
        "data.train_batch_size=0",
        "data.gen_batch_size=1",
        "actor_rollout_ref.hybrid_engine=False",
        *_batch_overrides(ppo_mini_batch_size),
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_store",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=0.5",
        "async_training.require_batches=1",
        "rollout.nnodes=1",
        "rollout.n_gpus_per_node=1",
        f"rollout.total_rollout_steps={total_rollout_steps}",
        f"rollout.n={ROLLOUT_N}",
    ]
    overrides += _ray_overrides(fake_gpus=2)
    overrides += _skip_dump_dir(skip_role(fully_async=True), dump_dir)
    return overrides + list(extra)


def one_step_off_overrides(
    assets: Assets,
    *,
    total_steps: int,
    experiment: str = "e",
    project: str = "p",
    extra: Sequence[str] = (),
) -> list[str]:
    """Hydra overrides for verl's one-step-off trainer (``verl.experimental.one_step_off_policy.main_ppo``):
    a ``total_steps``-step GRPO run with the trainer on one fake GPU and the rollout (``rollout.*``, its own
    resource pool, no hybrid engine) on another, weights synced through the shim's ``cpu_store`` engine."""
    overrides = _common_overrides(assets, experiment=experiment, project=project)
    overrides += [
        # its config finds verl's ppo_trainer at file://verl/trainer/config, relative to verl's source tree
        "hydra.searchpath=[pkg://verl.trainer.config]",
        f"data.train_batch_size={TRAIN_BATCH}",
        f"trainer.total_training_steps={total_steps}",
        "actor_rollout_ref.hybrid_engine=False",
        *_batch_overrides(TRAIN_BATCH),
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_store",
        "rollout.nnodes=1",
        "rollout.n_gpus_per_node=1",
    ]
    return overrides + _ray_overrides(fake_gpus=2) + list(extra)


def mode_overrides(
    assets: Assets, mode: str, *, steps: int = 3, extra: Sequence[str] = (), **kwargs: object
) -> tuple[tuple[str, ...], list[str]]:
    """``(launcher, overrides)`` for a named mode of :data:`MODES` (what the command line runs).

    ``steps`` is the number of trainer steps; ``kwargs`` go to the overrides builder
    (``dump_dir``, ``experiment``, ``project``).
    """
    if mode == "fully-async":
        mini = 2
        return ASYNC_LAUNCHER, fully_async_overrides(
            assets, total_rollout_steps=steps * mini, ppo_mini_batch_size=mini, extra=extra, **kwargs
        )
    settings = {
        "v0": {"use_v1": False},
        "v1": {"use_v1": True},
        "v1-separate": {"use_v1": True, "trainer_mode": "separate_async", "parameter_sync_step": 2},
        "v1-colocate": {"use_v1": True, "trainer_mode": "colocate_async"},
    }
    if mode not in settings:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    return MAIN_PPO_LAUNCHER, main_ppo_overrides(assets, total_steps=steps, extra=extra, **settings[mode], **kwargs)


def harness_env(assets: Assets, gen_log: Path | None) -> dict[str, str]:
    """Environment variables to add to ``os.environ`` for a run.

    Set in the launching process before verl calls ``ray.init``, they reach every Ray worker
    on this node. ``PYTHONPATH`` keeps whatever ``os.environ`` already has (the skipinject
    runner uses it too) and gets this directory appended, so ``verl_cpu_shim`` imports.
    """
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        # legacy_boot: verl 0.4/0.5 do not read VERL_USE_EXTERNAL_MODULES; its sitecustomize imports the shim.
        "PYTHONPATH": os.pathsep.join(dict.fromkeys([*current, str(HERE), str(HERE / "legacy_boot")])),
        # verl/__init__.py imports these modules in every process that imports verl.
        "VERL_USE_EXTERNAL_MODULES": "verl_cpu_shim",
        "VERL_PLATFORM": "cpu",
        # verl registers its FSDP engine for cuda/npu only; the engine itself runs on the platform device.
        "VERL_ENGINE_DEVICE": "cuda",
        "VERL_ENGINE_VENDOR": "nvidia",
        # verl 0.4/0.5's main_ppo calls ray.init without num_gpus: the shim adds this many fake GPUs.
        "VERL_CPU_FAKE_GPUS": "1",
        # INFO logging hits a verl 0.9.1 bug (logger.info(..., flush=True)) in separate_async.
        "VERL_LOGGING_LEVEL": "WARN",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DISABLE_IMPORT_WARNING": "1",
        # Ray prestarts a worker process per core for the first driver; verl's actors each ask for
        # resources or a runtime env of their own and never use them: two idle processes per run.
        "RAY_prestart_worker_first_driver": "0",
        "HARNESS_ASSETS": str(assets.root),
    }
    if gen_log is not None:
        env["VERL_CPU_GEN_LOG"] = str(Path(gen_log).resolve())
    return env


# -- running -----------------------------------------------------------------------------


def _session_pids(session: int) -> list[int]:
    """Processes of a session (Ray's daemons change their process group, not their session)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp session ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 3 and int(fields[3]) == session and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def _reap_session(session: int, grace: float = 10.0) -> int:
    """Stop what a run left behind in its session (Ray daemons, workers); returns how many were left."""
    left = _session_pids(session)
    if not left:
        return 0
    names = []
    for pid in left:
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session_pids(session):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _session_pids(session):
            time.sleep(0.2)
    logger.info("stopped %d processes left by the run: %s", len(left), ", ".join(names))
    return len(left)


def _run(
    assets: Assets,
    argv: list[str],
    *,
    gen_log: Path | None,
    timeout: float,
    cwd: Path | None,
    env_extra: dict[str, str] | None,
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **harness_env(assets, gen_log), **(env_extra or {})}
    if gen_log is not None:
        Path(gen_log).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="verl_cpu_run_") as scratch:
        start = time.monotonic()
        # A session of its own: whatever the run leaves (Ray daemons) can be found and stopped.
        child = subprocess.Popen(
            argv,
            cwd=str(cwd) if cwd is not None else scratch,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _reap_session(child.pid, grace=5.0)
            stdout, stderr = child.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr) from None
        finally:
            _reap_session(child.pid)
    elapsed = time.monotonic() - start
    logger.info("%s finished rc=%d in %.1fs", " ".join(argv[1:3]), child.returncode, elapsed)
    return subprocess.CompletedProcess(argv, child.returncode, stdout, stderr)


def run_main_ppo(
    assets: Assets,
    overrides: Sequence[str],
    *,
    gen_log: Path | None = None,
    launcher: Sequence[str] = MAIN_PPO_LAUNCHER,
    timeout: float = 600,
    cwd: Path | None = None,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``[*launcher, *overrides]`` with :func:`harness_env`; stdout/stderr captured as text.

    ``cwd`` defaults to a fresh temporary directory (Hydra writes ``outputs/`` there).
    ``env_extra`` is applied last. The run gets a session of its own; processes still in
    it when the launcher returns (or times out) are stopped, so no Ray cluster is left behind.
    On timeout the run is stopped and :class:`subprocess.TimeoutExpired` raised.
    """
    return _run(assets, [*launcher, *overrides], gen_log=gen_log, timeout=timeout, cwd=cwd, env_extra=env_extra)


def run_fully_async(
    assets: Assets,
    overrides: Sequence[str],
    *,
    gen_log: Path | None = None,
    launcher: Sequence[str] = ASYNC_LAUNCHER,
    timeout: float = 600,
    cwd: Path | None = None,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """:func:`run_main_ppo` with the fully async trainer as the default launcher."""
    return _run(assets, [*launcher, *overrides], gen_log=gen_log, timeout=timeout, cwd=cwd, env_extra=env_extra)


# -- the generation log ------------------------------------------------------------------


def gen_log_events(gen_log: Path, event: str | None = None) -> list[dict]:
    """All records of ``gen_log`` (or those of one ``event``); a missing file means none.

    Events written by the shim's ``hf`` rollout: ``server_start`` (a generation server
    loaded its model: the log works even when a run generates nothing), ``generate`` and
    ``weight_sync``.
    """
    try:
        text = Path(gen_log).read_text()
    except FileNotFoundError:
        return []
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in records if event is None or r.get("event") == event]


def generate_calls(gen_log: Path) -> list[dict]:
    """The ``generate`` records of ``gen_log``, one per request served by the shim's ``hf`` rollout.

    Each record: ``event`` (``"generate"``), ``pid``, ``time``, ``replica``, ``n_sequences``
    (always 1: verl's agent loops send one request per sequence), ``n_prompt_tokens``, ``prompt`` (a
    digest of the prompt's tokens: which prompt was generated),
    ``n_new_tokens``, ``weight_version`` (weight syncs the serving model had received),
    ``weight_digest`` (a digest of those weights' values) and ``global_steps`` (the trainer step of
    those weights, as verl passed it with them).
    """
    return gen_log_events(gen_log, "generate")


def weight_syncs(gen_log: Path) -> list[dict]:
    """The ``weight_sync`` records of ``gen_log``, one per state dict a generation server loaded (a trainer's
    weight sync into the rollout): ``n_tensors``, ``weight_version``, ``weight_digest``, ``global_steps``."""
    return gen_log_events(gen_log, "weight_sync")


def prompt_digests(assets: Assets, texts: Sequence[str]) -> dict[str, str]:
    """Digest -> user prompt, for ``texts`` as the agent loop sends them (the chat template applied
    with its generation prompt) and the shim logs them (a ``generate`` record's ``prompt``)."""
    import importlib.util

    from transformers import AutoTokenizer

    # The shim's module by its file: importing the package would install the shim in this process.
    spec = importlib.util.spec_from_file_location("verl_cpu_shim_genlog", HERE / "verl_cpu_shim" / "genlog.py")
    assert spec is not None and spec.loader is not None
    genlog = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(genlog)
    tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir))
    digests = {}
    for text in texts:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
        digests[genlog.prompt_digest([int(t) for t in ids])] = text
    return digests


def count_generate_calls(gen_log: Path) -> int:
    """Number of generate requests (= sequences generated) recorded in ``gen_log``; 0 if absent."""
    return sum(int(call.get("n_sequences", 1)) for call in generate_calls(gen_log))


def count_server_starts(gen_log: Path) -> int:
    """How many generation servers started: > 0 proves the log was wired even if no call was made."""
    return len(gen_log_events(gen_log, "server_start"))


# -- command line ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a real verl trainer for a few GRPO steps on CPU.")
    parser.add_argument("--mode", choices=MODES, default="v0")
    parser.add_argument("--steps", type=int, default=3, help="trainer steps")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "verl_cpu_harness")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--skipinject", action="store_true", help="launch through python -m skipinject")
    parser.add_argument("overrides", nargs="*", help="extra Hydra (or skip.*) overrides, appended last")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    workdir = args.workdir.resolve()
    assets = build_assets(workdir / "assets")
    launcher, overrides = mode_overrides(assets, args.mode, steps=args.steps, extra=args.overrides)
    if args.skipinject:
        launcher = (sys.executable, "-m", "skipinject", *launcher[1:])
    run_dir = workdir / f"run_{args.mode}_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir.mkdir(parents=True)
    gen_log = run_dir / "gen.jsonl"
    start = time.monotonic()
    proc = _run(
        assets,
        [*launcher, *overrides],
        gen_log=gen_log,
        timeout=args.timeout,
        cwd=run_dir,
        env_extra=None,
    )
    elapsed = time.monotonic() - start
    (run_dir / "stdout.txt").write_text(proc.stdout)
    (run_dir / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        print(proc.stderr[-6000:], file=sys.stderr)
    print(
        f"mode={args.mode} steps={args.steps} rc={proc.returncode} time={elapsed:.1f}s "
        f"generate_calls={count_generate_calls(gen_log)} servers={count_server_starts(gen_log)} run_dir={run_dir}"
    )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
