"""Prefill/decode disaggregation's settings (`--kv-transfer-config`, vLLM's flag and JSON)
and the checks on a request's `kv_transfer_params` (vLLM's field): what the engine core's
connector (engine/kv_transfer.py) and the proxy (entrypoints/disagg_proxy.py) exchange."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

CONNECTORS = ("NixlConnector",)
ROLES = ("kv_both", "kv_producer", "kv_consumer")
MAX_BLOCK_IDS = 1 << 20  # a prompt's full blocks (a million: 16M tokens at block size 16)
MAX_METADATA_CHARS = 64 << 10  # a NIXL agent's metadata, base64 (~600 characters here)
MAX_CACHES = 4096  # cache tensors (two a layer)


@dataclass
class KVTransferConfig:
    """`kv_connector`: NixlConnector (NIXL over UCX: RDMA, shared memory or TCP, whichever
    both ends have). `kv_role`: kv_producer (a prefill instance), kv_consumer (decode) or
    kv_both. Extra settings (`kv_connector_extra_config`): `hold_seconds` a prefill instance
    keeps a finished request's blocks for its decode instance to read (120), `timeout_seconds`
    a decode instance waits for a read (30), `backends` (["UCX"]), `secret_file`: a file both
    instances read whose contents sign the parameters the prefill side hands out (without
    one, a decode instance trusts any `kv_transfer_params` it is sent: keep it behind the
    proxy)."""

    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: Any) -> KVTransferConfig | None:
        """The config in `value` (its JSON text, a dict, or one; None: none given)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("--kv-transfer-config must be a JSON object, e.g. "
                                 '\'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'.'
                                 ) from None
        if not isinstance(value, dict):
            raise ValueError("--kv-transfer-config must be a JSON object.")
        known = {"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id",
                 "kv_buffer_device", "kv_ip", "kv_port", "kv_rank", "kv_parallel_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown key {unknown[0]!r} (it takes "
                             "kv_connector, kv_role, kv_connector_extra_config).")
        config = cls(value.get("kv_connector", "NixlConnector"), value.get("kv_role", "kv_both"),
                     dict(value.get("kv_connector_extra_config") or {}))
        config.check()
        return config

    def check(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"--kv-transfer-config: kv_connector {self.kv_connector!r} is not "
                             f"built here; use {' or '.join(CONNECTORS)}.")
        if self.kv_role not in ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(ROLES)}"
                             f", got {self.kv_role!r}.")
        extra = self.kv_connector_extra_config
        unknown = sorted(set(extra) - {"hold_seconds", "timeout_seconds", "backends",
                                       "secret_file"})
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown kv_connector_extra_config key "
                             f"{unknown[0]!r} (it takes hold_seconds, timeout_seconds, "
                             "backends, secret_file).")
        for name in ("hold_seconds", "timeout_seconds"):
            value = extra.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not 0 < value <= 86400):
                raise ValueError(f"--kv-transfer-config: {name} must be a number of seconds "
                                 f"in (0, 86400], got {value!r}.")
        backends = extra.get("backends", ["UCX"])
        if not isinstance(backends, list) or not backends or not all(
                isinstance(b, str) and b.isalnum() for b in backends):
            raise ValueError("--kv-transfer-config: backends must be a list of NIXL backend "
                             'names, e.g. ["UCX"].')
        if not isinstance(extra.get("secret_file", ""), str):
            raise ValueError("--kv-transfer-config: secret_file must be a path.")

    @property
    def hold_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("hold_seconds", 120))

    @property
    def timeout_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("timeout_seconds", 30))

    @property
    def backends(self) -> list[str]:
        return list(self.kv_connector_extra_config.get("backends", ["UCX"]))

    @property
    def secret(self) -> bytes | None:
        """The signing secret (None: none configured; ValueError: its file is unusable)."""
        path = self.kv_connector_extra_config.get("secret_file")
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                secret = f.read(4097).strip()
        except OSError as exc:
            raise ValueError(f"--kv-transfer-config: secret_file cannot be read "
                             f"({exc.strerror}).") from None
        if not 16 <= len(secret) <= 4096:
            raise ValueError("--kv-transfer-config: secret_file must hold 16 to 4096 bytes.")
        return secret


# a prefill instance's answer (do_remote_prefill) carries these besides vLLM's own names
_REMOTE = {"remote_engine_id": str, "remote_request_id": str, "remote_agent_metadata": str,
           "kv_layout": str, "last_block_hash": str, "signature": str}


def check_params(params: Any) -> dict | None:
    """A request's `kv_transfer_params`, checked (ValueError naming the problem): a prefill
    request asks {"do_remote_decode": true}; a decode request passes on what its prefill
    request answered. vLLM's other keys (remote_host, remote_port, tp_size) are ignored."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object.")
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    if not isinstance(decode or False, bool) or not isinstance(prefill or False, bool):
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill must be "
                         "true or false.")
    if decode and prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot "
                         "both be true.")
    if not prefill:
        return {"do_remote_decode": True} if decode else None
    out: dict[str, Any] = {"do_remote_prefill": True}
    for name, kind in _REMOTE.items():
        value = params.get(name)
        if name == "signature" and value is None:
            continue
        if not isinstance(value, kind) or not value or len(value) > MAX_METADATA_CHARS:
            raise ValueError(f"kv_transfer_params: {name} is missing or malformed (pass on "
                             "what the prefill instance answered).")
        out[name] = value
    for name, limit in (("remote_block_ids", MAX_BLOCK_IDS), ("remote_cache_addrs", MAX_CACHES)):
        value = params.get(name)
        if not isinstance(value, list) or len(value) > limit or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63
                for v in value):
            raise ValueError(f"kv_transfer_params: {name} must be a list of at most {limit} "
                             "non-negative integers.")
        out[name] = value
    expires = params.get("expires_at")
    if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(
            expires):
        raise ValueError("kv_transfer_params: expires_at must be a time (seconds since the "
                         "epoch).")
    out["expires_at"] = float(expires)
    return out


def signed_text(params: dict) -> bytes:
    """What a signature covers: every field but the signature, in one canonical form."""
    return json.dumps({k: v for k, v in params.items() if k != "signature"},
                      sort_keys=True, separators=(",", ":")).encode()
