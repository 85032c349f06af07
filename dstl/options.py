"""Parsing of documented dotted option keys, once, at the edge.

Each component keeps typed, frozen options (a dataclass that validates itself); its
``KEYS`` map a documented dotted key (``dstl.batch.delay-s``) to a field name and a
converter. :func:`parse_dotted` turns user-supplied strings into field values; an
unknown key or an unparsable value is a :class:`~dstl.errors.ConfigError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dstl.errors import ConfigError

Converter = Callable[[Any], Any]


def optional_float(raw: Any) -> float | None:
    """A float, or None for ``none`` (an option that can be switched off)."""
    if raw is None or str(raw).strip().lower() == "none":
        return None
    return float(raw)


def boolean(raw: Any) -> bool:
    """``true/false``, ``on/off``, ``yes/no``, ``1/0``."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("true", "on", "yes", "1"):
        return True
    if text in ("false", "off", "no", "0"):
        return False
    raise ValueError(f"not a boolean: {raw!r}")


def parse_dotted(
    keys: Mapping[str, tuple[str, Converter]], values: Mapping[str, Any], component: str
) -> dict[str, Any]:
    """Field values for ``values`` given as documented dotted keys."""
    out: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in keys:
            raise ConfigError(
                f"unknown {component} option {key!r}; known: {', '.join(sorted(keys))}"
            )
        name, convert = keys[key]
        try:
            out[name] = convert(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"option {key!r}: cannot parse {raw!r}") from exc
    return out
