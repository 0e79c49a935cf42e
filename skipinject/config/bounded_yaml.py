"""YAML checked for bounds before OmegaConf (or YAML's own composer) sees it.

A few hundred bytes of YAML with nested aliases (``&a [*b,*b]``) expand exponentially when composed;
OmegaConf then builds a node per value. Settings need no aliases or anchors, a few levels of nesting
and a few thousand values at most, so the document is first read as a stream of *events* (nothing is
composed or expanded) and refused, in one line, at the first anchor or alias, past
:data:`MAX_DEPTH` levels of nesting or past :data:`MAX_NODES` values. Reading stops there, so the
cost of a refusal is bounded by the limits, not by the document.
"""

from __future__ import annotations

from skipinject.errors import ConfigError

#: Settings files nest ``skip: role: key: [steps]``; a value in flow syntax a few levels more.
MAX_DEPTH = 16
#: Scalars and collections in one document: a steps list of this many separate items is already
#: far beyond what ranges (``1-128``) need.
MAX_NODES = 10_000


def check_yaml(text: str, where: str, failure: str = "cannot parse the value") -> None:
    """Raise :class:`ConfigError` naming ``where`` unless ``text`` is YAML without anchors or aliases,
    nested at most :data:`MAX_DEPTH` deep, with at most :data:`MAX_NODES` values (a syntax error is
    one line too: ``{where}: {failure} (YAML: ...)``). Errors name the key being read (``skip.rollout.steps``)."""
    import yaml  # type: ignore[import-untyped]

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    keys: list[str | None] = []  # per open collection: the mapping key being read (None: a sequence)
    expecting_key: list[bool] = []
    nodes = 0

    def at() -> str:
        named = [k for k in keys if k is not None]
        return f"{where}: {'.'.join(named)}" if named else where

    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent):
                raise ConfigError(f"{at()}: YAML aliases (*{event.anchor}) are not accepted in settings")
            if isinstance(event, yaml.CollectionEndEvent):
                keys.pop()
                expecting_key.pop()
                if expecting_key:
                    expecting_key[-1] = keys[-1] is not None  # a mapping's value ended: a key comes next
                continue
            if not isinstance(event, yaml.NodeEvent):
                continue
            if event.anchor is not None:
                raise ConfigError(f"{at()}: YAML anchors (&{event.anchor}) are not accepted in settings")
            nodes += 1
            if nodes > MAX_NODES:
                raise ConfigError(
                    f"{at()}: more than {MAX_NODES} YAML values; not a settings file "
                    "(write long step lists as ranges like 1-128)"
                )
            in_mapping = bool(expecting_key) and keys[-1] is not None
            if in_mapping and expecting_key[-1] and isinstance(event, yaml.ScalarEvent):
                keys[-1] = str(event.value)[:100]
                expecting_key[-1] = False
                continue
            if in_mapping:
                expecting_key[-1] = True  # this node is the value: a key comes next
            if isinstance(event, yaml.CollectionStartEvent):
                if len(keys) >= MAX_DEPTH:
                    raise ConfigError(f"{at()}: YAML nested more than {MAX_DEPTH} levels deep")
                is_mapping = isinstance(event, yaml.MappingStartEvent)
                keys.append("" if is_mapping else None)
                expecting_key.append(is_mapping)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())[:200]
        raise ConfigError(f"{where}: {failure} (YAML: {problem})") from None
