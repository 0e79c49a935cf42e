"""Run the real verl 0.9.1 trainers for a few GRPO steps on a CPU-only machine.

Everything a test needs is here: tiny local assets (model, tokenizer, data, reward),
the Hydra overrides, the environment that loads :mod:`verl_cpu_shim` in every verl
process, and thin launchers that capture the output::

    from harness import build_assets, main_ppo_overrides, run_main_ppo, count_generate_calls

    assets = build_assets(Path("/tmp/verl_cpu_assets"))
    proc = run_main_ppo(assets, main_ppo_overrides(assets, use_v1=False, total_steps=3),
                        gen_log=Path("/tmp/gen.jsonl"))
    assert proc.returncode == 0
    print(count_generate_calls(Path("/tmp/gen.jsonl")))

The launcher is a parameter so a wrapper such as ``python -m skipinject -m
verl.trainer.main_ppo`` can be put in front of the same overrides.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ASYNC_LAUNCHER",
    "MAIN_PPO_LAUNCHER",
    "V1_MODES",
    "Assets",
    "build_assets",
    "count_generate_calls",
    "fully_async_overrides",
    "harness_env",
    "main_ppo_overrides",
    "run_fully_async",
    "run_main_ppo",
]

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
ASSETS_VERSION = "1"
V1_MODES = ("sync", "separate_async", "colocate_async")
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


def build_assets(root: Path) -> Assets:
    """Build the tiny model, tokenizer, 32-row train/val parquet and reward file under ``root``.

    Idempotent: a marker written last makes later calls return at once. A partly built
    directory (no marker) is rebuilt in place.
    """
    root = Path(root).resolve()
    assets = _assets_at(root)
    marker = root / ".assets_version"
    if marker.is_file() and marker.read_text().strip() == ASSETS_VERSION:
        return assets
    start = time.monotonic()
    assets.model_dir.mkdir(parents=True, exist_ok=True)
    _build_model(assets.model_dir, vocab_size=_build_tokenizer(assets.model_dir))
    _build_data(assets.train_file, assets.val_file)
    assets.reward_file.write_text(_REWARD_SOURCE)
    marker.write_text(ASSETS_VERSION + "\n")
    logger.info("built CPU harness assets in %s (%.1fs)", root, time.monotonic() - start)
    return assets


# -- configuration -----------------------------------------------------------------------


def _common_overrides(assets: Assets, total_steps: int) -> list[str]:
    """Overrides every CPU run needs, whatever the trainer (see README for why each is there)."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={assets.train_file}",
        f"data.val_files={assets.val_file}",
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={RESPONSE_LEN}",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={TRAIN_BATCH * ROLLOUT_N}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={TRAIN_BATCH * ROLLOUT_N}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"reward.custom_reward_function.path={assets.reward_file}",
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={total_steps}",
        "trainer.val_before_train=False",
        "trainer.logger=[console]",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.project_name=verl_cpu",
        "trainer.experiment_name=harness",
    ]


def main_ppo_overrides(
    assets: Assets,
    *,
    use_v1: bool,
    total_steps: int,
    mode: str = "sync",
    extra: Sequence[str] = (),
) -> list[str]:
    """Hydra overrides for ``verl.trainer.main_ppo``: a ``total_steps``-step GRPO run on CPU.

    ``use_v1=False`` selects the V0 ``RayPPOTrainer``; ``use_v1=True`` the TransferQueue
    trainer in ``mode`` (``sync``, ``separate_async`` with ``parameter_sync_step=2``, or
    ``colocate_async``). ``extra`` is appended last, so it wins over the defaults.
    """
    if not use_v1 and mode != "sync":
        raise ValueError(f"mode={mode!r} needs use_v1=True (V0 only has the sync trainer)")
    if mode not in V1_MODES:
        raise ValueError(f"mode must be one of {V1_MODES}, not {mode!r}")
    overrides = _common_overrides(assets, total_steps)
    overrides += [f"data.train_batch_size={TRAIN_BATCH}", f"trainer.use_v1={use_v1}"]
    if mode == "separate_async":
        sync_step = 2
        overrides += [
            f"actor_rollout_ref.actor.ppo_mini_batch_size={TRAIN_BATCH // sync_step}",
            f"trainer.v1.trainer_mode={mode}",
            f"trainer.v1.{mode}.parameter_sync_step={sync_step}",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_store",
        ]
    else:
        overrides.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={TRAIN_BATCH}")
        if use_v1:
            overrides.append(f"trainer.v1.trainer_mode={mode}")
    if use_v1:
        overrides.append("transfer_queue.backend.SimpleStorage.num_data_storage_units=1")
    overrides += _ray_overrides(fake_gpus=2 if mode == "separate_async" else 1)
    return overrides + list(extra)


def _ray_overrides(fake_gpus: int) -> list[str]:
    """Local Ray: enough logical CPUs for verl's actors, ``fake_gpus`` fake GPU resources."""
    return [
        f"ray_kwargs.ray_init.num_cpus={16 if fake_gpus == 1 else 32}",
        f"++ray_kwargs.ray_init.num_gpus={fake_gpus}",
    ]


def fully_async_overrides(assets: Assets, *, total_steps: int = 2, extra: Sequence[str] = ()) -> list[str]:
    """Hydra overrides for ``fully_async_main``: one trainer GPU, one standalone rollout GPU.

    The rollouter feeds one prompt at a time (``gen_batch_size=1``) and stops after
    ``2 * total_steps`` prompts; the trainer takes one prompt group per step
    (``require_batches=1``, mini-batch 1) and syncs weights every step.
    """
    overrides = _common_overrides(assets, total_steps)
    overrides += [
        "data.train_batch_size=0",
        "data.gen_batch_size=1",
        "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_store",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=0.5",
        "async_training.require_batches=1",
        "rollout.nnodes=1",
        "rollout.n_gpus_per_node=1",
        f"rollout.total_rollout_steps={2 * total_steps}",
        f"rollout.n={ROLLOUT_N}",
    ]
    overrides += _ray_overrides(fake_gpus=2)
    return overrides + list(extra)


def harness_env(assets: Assets, gen_log: Path | None) -> dict[str, str]:
    """Environment variables to add for a run (they reach every Ray worker on this node)."""
    pythonpath = [str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(pythonpath)),
        "VERL_USE_EXTERNAL_MODULES": "verl_cpu_shim",
        "VERL_PLATFORM": "cpu",
        # verl registers its FSDP engine for cuda/npu only; the engine itself runs on the platform device.
        "VERL_ENGINE_DEVICE": "cuda",
        "VERL_ENGINE_VENDOR": "nvidia",
        # INFO logging hits a verl 0.9.1 bug (logger.info(..., flush=True)) with hybrid_engine=False.
        "VERL_LOGGING_LEVEL": "WARN",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DISABLE_IMPORT_WARNING": "1",
    }
    if gen_log is not None:
        env["VERL_CPU_GEN_LOG"] = str(Path(gen_log).resolve())
    return env


# -- running -----------------------------------------------------------------------------


def _run(
    assets: Assets,
    argv: list[str],
    *,
    gen_log: Path | None,
    timeout: float,
    cwd: Path | None,
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **harness_env(assets, gen_log)}
    with tempfile.TemporaryDirectory(prefix="verl_cpu_run_") as scratch:
        start = time.monotonic()
        proc = subprocess.run(
            argv,
            cwd=str(cwd) if cwd is not None else scratch,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
    logger.info("%s finished rc=%d in %.1fs", " ".join(argv[:3]), proc.returncode, time.monotonic() - start)
    return proc


def run_main_ppo(
    assets: Assets,
    overrides: Sequence[str],
    *,
    launcher: Sequence[str] = MAIN_PPO_LAUNCHER,
    gen_log: Path | None = None,
    timeout: float = 600,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``launcher + overrides`` with :func:`harness_env`; output is captured.

    ``cwd`` defaults to a fresh temporary directory (Hydra writes ``outputs/`` there).
    """
    return _run(assets, [*launcher, *overrides], gen_log=gen_log, timeout=timeout, cwd=cwd)


def run_fully_async(
    assets: Assets,
    overrides: Sequence[str],
    *,
    launcher: Sequence[str] = ASYNC_LAUNCHER,
    gen_log: Path | None = None,
    timeout: float = 600,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """:func:`run_main_ppo` with the fully async trainer as the default launcher."""
    return _run(assets, [*launcher, *overrides], gen_log=gen_log, timeout=timeout, cwd=cwd)


def count_generate_calls(gen_log: Path) -> int:
    """Number of generate requests recorded in ``gen_log`` (0 if it does not exist)."""
    try:
        text = Path(gen_log).read_text()
    except FileNotFoundError:
        return 0
    return sum(1 for line in text.splitlines() if line.strip() and json.loads(line))
