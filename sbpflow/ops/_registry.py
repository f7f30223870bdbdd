"""The registry of SBP rules (filled by the op-family modules)."""

from __future__ import annotations

from typing import Any, Callable

_rules: dict[Any, Callable[..., Any]] = {}


def lookup(func: Any) -> Callable[..., Any] | None:
    rule = _rules.get(func)
    if rule is None:
        packet = getattr(func, "overloadpacket", None)
        rule = _rules.get(packet)
    return rule


def run_rule(rule: Callable[..., Any], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return rule(func, args, kwargs)
