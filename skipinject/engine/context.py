"""A role with its settings in this process, as every part of the engine sees it."""

from __future__ import annotations

import logging
import threading
from typing import Any

from skipinject.config import RoleConfig
from skipinject.roles import Call, Codec, Role

logger = logging.getLogger("skipinject")


class RoleContext:
    """The role, its settings and the plugin that provides it; its codec, fingerprints and one-time lines."""

    def __init__(self, role: Role, settings: RoleConfig, owner: str) -> None:
        self.role = role
        self.settings = settings
        self.owner = owner
        self._lock = threading.Lock()
        self._warned: set[Any] = set()
        self._default_codec: Codec | None = None

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def codec(self) -> Codec:
        if self.role.codec is not None:
            return self.role.codec
        if self._default_codec is None:
            from skipinject.verl.codecs import DataProtoCodec

            self._default_codec = DataProtoCodec()
        return self._default_codec

    def once(self, key: Any, level: int, message: str, *args: Any) -> None:
        """Log ``message`` the first time ``key`` is seen."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.log(level, message, *args)

    def fingerprint(self, call: Call) -> list[str] | None:
        """The role's per-row digests of the call's inputs, or ``None`` (one warning when it fails)."""
        if self.role.fingerprint is None:
            return None
        try:
            rows = self.role.fingerprint(call)
        except Exception as exc:
            self.once(
                ("fingerprint", type(exc)),
                logging.WARNING,
                "%s: cannot fingerprint the inputs (%s); mismatches will not be detected",
                self.name,
                exc,
            )
            return None
        return None if rows is None else [str(r) for r in rows]

    def extra_meta(self, call: Call) -> dict[str, Any]:
        """The role's ``record_meta`` fields for a result of ``call`` (none when it fails: one warning), and
        the values of its ``match_settings`` (a later miss names those that differ)."""
        recorded: dict[str, Any] = {}
        if self.role.match_settings:
            from skipinject.report.misses import SETTINGS_KEY, recorded_settings

            try:
                recorded[SETTINGS_KEY] = recorded_settings(self.role.match_settings, call.run_config)
            except Exception:  # only the explanation of a later miss depends on it
                pass
        if self.role.record_meta is None:
            return recorded
        try:
            return {**recorded, **dict(self.role.record_meta(call) or {})}
        except Exception as exc:
            self.once(
                ("record_meta", type(exc)),
                logging.WARNING,
                "%s: cannot describe the result for meta.json (%s: %s); saved without it",
                self.name,
                type(exc).__name__,
                exc,
            )
            return {}

    def after_miss(self, call: Call, result: Any) -> Any:
        if self.role.on_miss is None:
            return result
        return self.role.on_miss(result, call)
