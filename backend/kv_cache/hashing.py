"""Prefix-cache keys: the cache namespace and the chained block hash.

Every field is length-prefixed or tagged, so no two distinct inputs share an encoding
(a tenant name can never spill into the adapter digest, a token list can never spill
into ``extra``, and ``None`` differs from the empty string).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_NS_DOMAIN = b"loraplex/kv-namespace/v1\x00"
_BLOCK_DOMAIN = b"loraplex/kv-block/v1\x00"
_U64 = struct.Struct("<Q")


def _field(value: str | None) -> bytes:
    """Tagged, length-prefixed encoding of an optional string (None != "")."""
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + _U64.pack(len(raw)) + raw


def namespace_key(tenant: str | None, adapter_digest: str | None) -> bytes:
    """Domain-separated, length-prefixed encoding of the cache namespace (no two (tenant, digest) pairs alias; None differs from "")."""
    return _NS_DOMAIN + _field(tenant) + _field(adapter_digest)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """sha256 chain H(parent, tokens, extra) with unambiguous encoding."""
    h = hashlib.sha256(_BLOCK_DOMAIN)
    if parent is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + _U64.pack(len(parent)) + parent)
    n = len(token_ids)
    h.update(_U64.pack(n))
    h.update(struct.pack(f"<{n}q", *token_ids))
    h.update(_U64.pack(len(extra)))
    h.update(extra)
    return h.digest()
