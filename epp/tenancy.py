"""Tenant isolation of prefix caches: a per-tenant `cache_salt` the client cannot choose. Pure.

A trusted header (set by the gateway's authentication, e.g. `x-tenant-id`) names the tenant.
The EPP derives the tenant's salt with a server-side secret,

    cache_salt = "t1-" + hex(HMAC-SHA256(secret, "tenant:" + tenant))[:32]

writes it into the request body (replacing any client-sent `cache_salt`) and keys the prompt's
blocks with it, so engines only reuse KV within a tenant and the routing never gives one
tenant affinity for another's prefixes. Requests without the header are either rejected
(`missing: reject`, 403) or share one namespace (`missing: shared`, the salt of the empty
tenant, still chosen by the EPP, not the client). Every replica with the same secret derives
the same salts, so caches survive restarts and active-active replicas agree.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from epp.requests import RequestError

MISSING_POLICIES = ("shared", "reject")
MIN_SECRET_BYTES = 16
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class TenancyConfig:
    """The `tenancy` config section; the secret itself is read at startup from a file or env var."""

    header: str = "x-tenant-id"
    missing: str = "shared"
    secret_file: str | None = None
    secret_env: str | None = None

    def check(self) -> tuple[str, str] | None:
        if not self.header or self.header != self.header.strip() or ":" in self.header:
            return "header", f"must be an HTTP header name, got {self.header!r}"
        if self.missing not in MISSING_POLICIES:
            return "missing", f"must be one of {', '.join(MISSING_POLICIES)}, got {self.missing!r}"
        if (self.secret_file is None) == (self.secret_env is None):
            return "secretFile", "give exactly one of secretFile or secretEnv (the HMAC secret for salts)"
        return None


class TenantSalter:
    def __init__(self, header: str, secret: bytes, missing: str = "shared") -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the tenancy secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}"
            )
        if missing not in MISSING_POLICIES:
            raise ValueError(f"missing must be one of {MISSING_POLICIES}, got {missing!r}")
        self.header = header.lower()
        self.missing = missing
        self._secret = secret
        self._cache: dict[str, str] = {}

    def salt(self, tenant: str) -> str:
        s = self._cache.get(tenant)
        if s is None:
            digest = hmac.new(self._secret, b"tenant:" + tenant.encode("utf-8"), hashlib.sha256).hexdigest()
            s = "t1-" + digest[:32]
            if len(self._cache) < 100_000:
                self._cache[tenant] = s
        return s

    def tenant_of(self, headers: Mapping[str, str]) -> str:
        """The tenant named by the trusted header ("" = shared). Raises RequestError (403) when the
        header is missing and such requests are rejected."""
        tenant = headers.get(self.header, "").strip()
        if "," in tenant:  # sent more than once (or a list): which copy the gateway vouched for is unknown
            raise RequestError(
                403, "TenantAmbiguous", f"header {self.header!r} must name exactly one tenant, once"
            )
        if not tenant and self.missing == "reject":
            raise RequestError(403, "TenantRequired", f"header {self.header!r} naming the tenant is required")
        return tenant

    def apply(self, headers: Mapping[str, str], doc: dict[str, Any]) -> bytes:
        """Write the tenant's salt into `doc` (replacing the client's) and return the new body."""
        doc["cache_salt"] = self.salt(self.tenant_of(headers))
        return _encoder.encode(doc)
