"""A toy "trainer" whose rollout is expensive: what skipinject is for, without verl."""

from __future__ import annotations

import random
import time


class ToyTrainer:
    def __init__(self, seconds_per_rollout: float = 1.0) -> None:
        self.global_steps = 0
        self.seconds_per_rollout = seconds_per_rollout

    def generate(self, prompts: list[str]) -> dict[str, list]:
        """The expensive part: 'generate' a response per prompt."""
        time.sleep(self.seconds_per_rollout)
        rng = random.Random()
        return {"prompts": prompts, "responses": [f"{p} -> {rng.randint(0, 999)}" for p in prompts]}

    def fit(self, steps: int) -> None:
        for step in range(1, steps + 1):
            self.global_steps = step
            started = time.perf_counter()
            rollout = self.generate([f"prompt {step}.{i}" for i in range(3)])
            print(f"step {step}: {rollout['responses']} ({time.perf_counter() - started:.2f} s)", flush=True)
