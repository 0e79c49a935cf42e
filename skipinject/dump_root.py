"""A role's ``dump_dir`` parsed once into a :class:`DumpRoot`: a local directory or a remote store's URL.

The config validates it, the engine opens stores from it and :mod:`skipinject.cluster` asks whether other
nodes see it. Nothing here imports fsspec or the store until a root is opened."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from skipinject.errors import ConfigError

if TYPE_CHECKING:
    from skipinject.store import Backend

__all__ = ["LOCAL_SCHEMES", "DumpRoot", "anchored", "is_remote", "is_url", "local_path_text"]

#: URL schemes that name this node's own file system (``file:///srv/cache`` is ``/srv/cache``).
LOCAL_SCHEMES = ("file", "local")


def is_url(path: str) -> bool:
    """``scheme://...`` (s3://, hdfs://, file://...)."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


def is_remote(path: str) -> bool:
    """A URL of a store other than this node's file system (s3://, gs://, hdfs://...)."""
    return is_url(path) and str(path).partition("://")[0].lower() not in LOCAL_SCHEMES


def local_path_text(path: str) -> str:
    """``path`` without a ``file://`` (or ``local://``) scheme; other text as it is."""
    return str(path).partition("://")[2] if is_url(path) and not is_remote(path) else str(path)


def anchored(text: str) -> str:
    """``text``, a relative local path joined to this process's working directory: handed to the run's other
    processes, which may start elsewhere (Ray's workers), it names the directory the user meant."""
    text = str(text)
    if is_url(text) or text.startswith("~") or os.path.isabs(text):
        return text
    try:
        return os.path.join(os.getcwd(), text)
    except OSError:  # the working directory is gone: each process resolves it as before
        return text


@dataclass(frozen=True)
class DumpRoot:
    """A cache root: ``path`` (local, ``~`` expanded and resolved; ``file://`` URLs included) or ``url``
    (a remote store, as given without a trailing ``/``). ``text`` is what the user wrote."""

    text: str
    path: Path | None = None
    url: str | None = None

    @classmethod
    def parse(cls, text: str) -> DumpRoot:
        text = str(text)
        if is_remote(text):
            return cls(text, url=text.rstrip("/") or text)
        try:
            return cls(text, path=Path(local_path_text(text)).expanduser().resolve())
        except (RuntimeError, OSError) as exc:  # ``~user`` unknown, no home directory, a symlink loop
            raise ConfigError(f"not a usable directory path ({exc})") from None

    @property
    def scheme(self) -> str:
        """The URL's scheme (``s3``), ``""`` for a local root."""
        return self.url.partition("://")[0].lower() if self.url is not None else ""

    def __str__(self) -> str:
        return self.url if self.url is not None else str(self.path)

    def check(self, key: str) -> None:
        """Refuse (ConfigError naming ``key``) a URL no installed fsspec implementation can open."""
        if self.url is None:
            return
        scheme = self.scheme
        try:
            import fsspec
        except ImportError as exc:
            raise ConfigError(
                f"{key}={self.text}: a URL needs fsspec (pip install fsspec and, for {scheme}://, "
                "its package, e.g. s3fs or gcsfs)"
            ) from exc
        try:
            fsspec.get_filesystem_class(scheme)
        except ValueError as exc:
            raise ConfigError(f"{key}={self.text}: fsspec knows no protocol {scheme!r}") from exc
        except ImportError as exc:
            raise ConfigError(f"{key}={self.text}: {' '.join(str(exc).split()) or type(exc).__name__}") from exc

    def location(self) -> Path:
        """The root as the store joins it: a ``Path``, or a remote one (:func:`skipinject.store.location_for`)."""
        if self.path is not None:
            return self.path
        from skipinject.store import location_for

        return location_for(cast(str, self.url))

    def backend(self, *, trust_permissions: bool = False) -> Backend:
        """Where the root's files are moved (:func:`skipinject.store.backend_for`): a local root as the user gave it."""
        from skipinject.store import backend_for

        given = Path(local_path_text(self.text)).expanduser() if self.url is None else None
        return backend_for(self.url, given=given, trust_permissions=trust_permissions)
