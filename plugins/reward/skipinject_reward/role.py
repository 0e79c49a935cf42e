"""Role ``reward``: the reward the V0 ``RayPPOTrainer`` takes for a training step.

``fit`` gets a step's reward from one module-level function defined in ``verl.trainer.ppo.reward``,
patched there and wherever it is bound: ``verl.trainer.ppo.ray_trainer`` (``RayPPOTrainer.fit``), the
separation trainer under the fully async one, the one-step-off trainer and verl-recipe's DAPO all import
it from that module:

* verl >= 0.7.1: ``extract_reward(batch)``. The rule-based or custom reward function
  (``reward.custom_reward_function.path``) already ran per sample inside the rollout's agent loop
  (verl's reward loop), and a colocated reward model in ``_compute_reward_colocate``; this is where
  the trainer turns that into ``(reward_tensor, reward_extra_infos_dict)`` for training.
* verl < 0.7.1 (0.7.0 and older): ``compute_reward(data, reward_fn)``, which runs the reward function itself.

On a hit the trainer trains on the cached reward of the step, the reward function is not
called (verl < 0.7.1) and the batch's own scores are ignored (verl >= 0.7.1). Calls carry no step,
so the step is the trainer's ``global_steps`` captured entering ``fit``. Validation batches
(``meta_info["validate"]``) always run the original.
"""

from __future__ import annotations

from typing import Any

from skipinject import Call, Role, StepSource, Target, attended_tokens, hookimpl, row_digest, row_text, select

from skipinject_reward.codec import RewardCodec, batch_of

TARGETS = (
    Target("verl.trainer.ppo.reward:extract_reward", verl=">=0.7.1"),
    Target("verl.trainer.ppo.reward:compute_reward", verl="<0.7.1"),
)
CLOCK = "verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit"
#: Per-row non-tensor inputs of a reward function (the answer to score against and its source).
ROW_KEYS = ("data_source", "reward_model")


def cannot_fire(config: Any) -> str | None:
    # The fully async and one-step-off trainers (a top-level ``rollout`` section: their own rollout
    # resources) run on RayPPOTrainer whatever trainer.use_v1 says.
    if select(config, "trainer.use_v1") is True and select(config, "rollout") is None:
        return (
            "trainer.use_v1=True runs the V1 trainer, which takes rewards from TransferQueue, not from "
            "ray_trainer's reward function; set trainer.use_v1=False for the V0 RayPPOTrainer"
        )
    if select(config, "reward_model.launch_reward_fn_async", False):
        return "reward_model.launch_reward_fn_async=True computes rewards in a Ray task, which is not patched"
    return None


def input_fingerprint(call: Call) -> list[str] | None:
    """One digest per row: its prompt and response tokens and what it is scored against."""
    batch = batch_of(call)
    tokens = attended_tokens(getattr(batch, "batch", None))
    if tokens is None:
        return None
    non_tensor = getattr(batch, "non_tensor_batch", None) or {}
    columns = [non_tensor[key] for key in ROW_KEYS if key in non_tensor]
    return [row_digest(row, *(row_text(column[index]) for column in columns)) for index, row in enumerate(tokens)]


REWARD = Role(
    name="reward",
    targets=TARGETS,
    step=StepSource.clock("global_steps"),
    codec=RewardCodec(),
    clocks=[CLOCK],
    check=cannot_fire,
    fingerprint=input_fingerprint,
    description="the reward the V0 RayPPOTrainer trains on at a step (trainer.use_v1=False)",
)


@hookimpl
def skipinject_roles() -> list[Role]:
    return [REWARD]
