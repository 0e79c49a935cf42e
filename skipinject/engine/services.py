"""What replay, recording and matching use of their role in this process (its
:class:`~skipinject.engine.runtime.RoleRuntime` provides it): the role and its settings, codec and input
fingerprints, its stores, its one-time lines, and the result hooks. The cache code's parts depend on this, not
on the runtime that holds them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from skipinject.config import RoleConfig
    from skipinject.roles import Call, Codec, Role
    from skipinject.store import StepStore


class Services(Protocol):
    """A role's services to its replay, recorder and matcher."""

    name: str
    role: Role
    settings: RoleConfig

    @property
    def codec(self) -> Codec: ...

    @property
    def unwritable_root(self) -> bool: ...

    def once(self, key: Any, level: int, message: str, *args: Any) -> None: ...

    def fingerprint(self, call: Call) -> list[str] | None: ...

    def extra_meta(self, call: Call) -> dict[str, Any]: ...

    def store_for(self, call: Call) -> StepStore: ...

    def unusable(self, store: StepStore) -> str | None: ...

    def batch_size_stores(self, store: StepStore, limit: int) -> list[StepStore]: ...

    def open(self, project: Path, context: dict[str, Any]) -> StepStore: ...

    def deliver(self, call: Call, result: Any) -> Any: ...

    def after_miss(self, call: Call, result: Any) -> Any: ...
