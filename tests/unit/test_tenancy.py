"""Tenant isolation: per-tenant cache salts the client cannot choose, derived with a server-side secret."""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest

from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.requests import RequestError
from epp.tenancy import MIN_SECRET_BYTES, TenancyConfig, TenantSalter
from epp.testing.fakes import token_request

SECRET = b"0123456789abcdef-secret"
OTHER_SECRET = b"fedcba9876543210-secret"


def test_salt_is_hmac_of_the_tenant_with_the_secret() -> None:
    salter = TenantSalter("x-tenant-id", SECRET)
    digest = hmac.new(SECRET, b"tenant:acme", hashlib.sha256).hexdigest()
    assert salter.salt("acme") == "t1-" + digest[:32]
    assert len(salter.salt("acme")) == 35


def test_salts_are_deterministic_across_instances_with_the_same_secret() -> None:
    a, b = TenantSalter("x-tenant-id", SECRET), TenantSalter("x-tenant-id", SECRET, "reject")
    tenants = ["acme", "globex", "", "ünïcode", "a" * 300]
    assert [a.salt(t) for t in tenants] == [b.salt(t) for t in tenants]
    assert a.salt("acme") == a.salt("acme")  # cached value is the same value


def test_different_tenants_and_different_secrets_give_different_salts() -> None:
    a, other = TenantSalter("x-tenant-id", SECRET), TenantSalter("x-tenant-id", OTHER_SECRET)
    tenants = ["acme", "globex", "acme ", "Acme", ""]
    assert len({a.salt(t) for t in tenants}) == len(tenants)
    for t in tenants:
        assert a.salt(t) != other.salt(t)


def test_apply_overrides_the_client_cache_salt_and_keeps_the_rest_of_the_body() -> None:
    salter = TenantSalter("x-tenant-id", SECRET)
    doc = {"model": "m", "prompt": "hi", "cache_salt": "t1-chosen-by-the-client", "max_tokens": 5}
    body = salter.apply({"x-tenant-id": "acme"}, doc)
    sent = msgspec.json.decode(body)
    assert sent == {"model": "m", "prompt": "hi", "cache_salt": salter.salt("acme"), "max_tokens": 5}
    assert doc["cache_salt"] == salter.salt("acme")


def test_a_client_cannot_pick_another_tenants_salt() -> None:
    salter = TenantSalter("x-tenant-id", SECRET)
    victim = salter.salt("victim")
    body = salter.apply({"x-tenant-id": "attacker"}, {"model": "m", "cache_salt": victim})
    assert msgspec.json.decode(body)["cache_salt"] == salter.salt("attacker") != victim


@pytest.mark.parametrize("headers", [{}, {"x-tenant-id": ""}, {"x-tenant-id": "   "}, {"x-other": "acme"}])
def test_missing_tenant_header_shares_one_epp_chosen_salt(headers: dict[str, str]) -> None:
    salter = TenantSalter("x-tenant-id", SECRET, "shared")
    assert salter.tenant_of(headers) == ""
    body = salter.apply(headers, {"model": "m", "cache_salt": "mine"})
    assert msgspec.json.decode(body)["cache_salt"] == salter.salt("") != "mine"


@pytest.mark.parametrize("headers", [{}, {"x-tenant-id": "  "}])
def test_missing_tenant_header_is_rejected_with_403_when_configured(headers: dict[str, str]) -> None:
    salter = TenantSalter("x-tenant-id", SECRET, "reject")
    doc = {"model": "m"}
    with pytest.raises(RequestError) as err:
        salter.apply(headers, doc)
    assert err.value.status == 403
    assert err.value.code == "TenantRequired"
    assert "x-tenant-id" in err.value.message
    assert "cache_salt" not in doc
    assert salter.tenant_of({"x-tenant-id": " acme "}) == "acme"


def test_the_header_name_is_matched_in_lower_case() -> None:
    salter = TenantSalter("X-Org-Id", SECRET)
    assert salter.header == "x-org-id"
    assert salter.tenant_of({"x-org-id": "acme"}) == "acme"


@pytest.mark.parametrize("secret", [b"", b"short", b"x" * (MIN_SECRET_BYTES - 1)])
def test_a_short_secret_is_rejected(secret: bytes) -> None:
    with pytest.raises(ValueError, match=f"at least {MIN_SECRET_BYTES} bytes"):
        TenantSalter("x-tenant-id", secret)


def test_a_secret_of_the_minimum_length_is_accepted() -> None:
    assert TenantSalter("x-tenant-id", b"x" * MIN_SECRET_BYTES).salt("a").startswith("t1-")


def test_an_unknown_missing_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="missing must be one of"):
        TenantSalter("x-tenant-id", SECRET, "maybe")


def test_tenant_salts_separate_the_prompts_block_keys() -> None:
    """The salt is part of the block-key root: the same prompt keys differently per tenant."""
    salter = TenantSalter("x-tenant-id", SECRET)
    svc = KvIndexService(BlockIndex(16, 1000), FreshnessTracker(), TokenizerRegistry({}), 16)
    prompt = list(range(64))
    keys_a = svc.prompt_keys(token_request(prompt, cache_salt=salter.salt("a")))
    keys_a2 = svc.prompt_keys(token_request(prompt, cache_salt=salter.salt("a")))
    keys_b = svc.prompt_keys(token_request(prompt, cache_salt=salter.salt("b")))
    assert keys_a is not None and keys_a2 is not None and keys_b is not None
    assert len(keys_a) == len(keys_b) == 4
    assert list(keys_a) == list(keys_a2)
    assert not set(keys_a.tolist()) & set(keys_b.tolist())


# -- TenancyConfig.check --------------------------------------------------------------------------
def test_config_check_accepts_a_valid_section() -> None:
    assert TenancyConfig(secret_env="EPP_TENANCY_SECRET").check() is None
    assert TenancyConfig(header="x-org", missing="reject", secret_file="/run/secret").check() is None


@pytest.mark.parametrize(
    ("config", "field", "fragment"),
    [
        (TenancyConfig(), "secretFile", "exactly one of secretFile or secretEnv"),
        (TenancyConfig(secret_file="/f", secret_env="E"), "secretFile", "exactly one"),
        (TenancyConfig(missing="maybe", secret_env="E"), "missing", "'maybe'"),
        (TenancyConfig(header="", secret_env="E"), "header", "HTTP header name"),
        (TenancyConfig(header=" x-tenant", secret_env="E"), "header", "HTTP header name"),
        (TenancyConfig(header="x-tenant:", secret_env="E"), "header", "HTTP header name"),
    ],
)
def test_config_check_names_the_bad_field(config: TenancyConfig, field: str, fragment: str) -> None:
    problem = config.check()
    assert problem is not None
    assert problem[0] == field
    assert fragment in problem[1]
