"""A skipinject role for the toy trainer, as a plugin module (no packaging needed)."""

from __future__ import annotations

from typing import Any

from skipinject import Call, Payload, Role, StepSource, Target, hookimpl


class JsonCodec:
    """Results that are plain JSON values (no tensors)."""

    def encode(self, result: Any) -> Payload:
        return Payload(objects={"result": result}, rows=len(result["responses"]))

    def decode(self, payload: Payload, call: Call) -> Any:
        return payload.objects["result"]


@hookimpl
def skipinject_roles() -> list[Role]:
    return [
        Role(
            name="toy_rollout",
            targets=[Target("toy_lib:ToyTrainer.generate")],
            step=StepSource.attribute("global_steps"),  # the trainer's own step counter
            codec=JsonCodec(),
        )
    ]
