"""Tenants (`--scheduling-policy fair`): their weights (`--tenant-weights`), how a request's
tenant is named (the `--tenant-header` header, else its API key's digest, else "default"),
and the checks on both."""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

from tokenmill.config.json_flag import json_object

DEFAULT_TENANT = "default"  # a request that names none
OTHER_TENANT = "other"  # the metrics' label of every tenant --tenant-weights does not name
MAX_TENANTS = 1024  # names --tenant-weights may give
_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,64}")


def parse_weights(value: Any) -> dict[str, float]:
    """`--tenant-weights`: a dict, its JSON text or `name=weight,...`; each name 1-64 of
    letters, digits and `._:@-`, each weight a finite number > 0 (ValueError naming the bad
    one). A tenant it does not name has weight 1."""
    if value is None or isinstance(value, str) and not value.strip():
        return {}
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        pairs = {}
        for part in value.split(","):
            name, sep, weight = part.partition("=")
            if not sep:
                raise ValueError(f"--tenant-weights: {part.strip()!r} is not name=weight.")
            pairs[name.strip()] = weight.strip()
        value = pairs
    weights = json_object(value, "--tenant-weights", '{"gold": 3, "free": 1}') or {}
    if len(weights) > MAX_TENANTS:
        raise ValueError(f"--tenant-weights names at most {MAX_TENANTS} tenants.")
    parsed = {}
    for name, weight in weights.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"--tenant-weights: tenant name {name!r} must be 1-64 letters, "
                             "digits or ._:@-")
        try:
            number = float(weight)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(weight, bool) or not math.isfinite(number) or number <= 0:
            raise ValueError(f"--tenant-weights: {name}'s weight must be a number > 0, "
                             f"got {weight!r}.")
        parsed[name] = number
    return parsed


def tenant_of(header: str | None, api_key: str | None) -> str:
    """A request's tenant: its tenant header's value (ValueError when it is not a tenant
    name), else `key-` and 12 hex digits of its API key's SHA-256 (never the key itself),
    else "default"."""
    if header is not None:
        header = header.strip()
        if not _NAME.fullmatch(header):
            raise ValueError("The tenant header must be 1-64 letters, digits or ._:@-")
        return header
    if api_key:
        return "key-" + hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return DEFAULT_TENANT


def metrics_label(tenant: str, weights: dict[str, float]) -> str:
    """The label a tenant's metrics carry: its name where --tenant-weights gives it (or the
    default tenant), else "other" (so no client can mint series)."""
    if tenant in ("", DEFAULT_TENANT):
        return DEFAULT_TENANT
    return tenant if tenant in weights else OTHER_TENANT


def check_max_queue_time(value: Any, name: str = "max_queue_time") -> float | None:
    """A queue-time limit in seconds: None (none), or a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}.")
    return float(value)
