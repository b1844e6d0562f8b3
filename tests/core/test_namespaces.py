"""Namespace records (lmcache_core.namespaces): what an engine leaves in its tiers so
``lmcache-core erase --model/--tenant`` can find its ids. Records come back from
storage as untrusted bytes: anything malformed is skipped, never raised."""

from __future__ import annotations

import json
import logging

import pytest

from lmcache_core.config import ConfigError, CoreConfig
from lmcache_core.keys import KeyNamespace
from lmcache_core.namespaces import MAX_RECORD_BYTES, NamespaceRecord, namespace_of, parse_records, record_in_tiers

NS = KeyNamespace(model="org/model-a", layout="vllm/paged", dtype="bfloat16", world_size=2, rank=1, salt="secret-salt")


def test_a_record_round_trips_and_holds_no_salt() -> None:
    r = NamespaceRecord.of(NS, "acme")
    raw = r.to_bytes()
    assert NamespaceRecord.from_bytes(NS.id, raw) == r
    assert (r.model, r.tenant, r.world_size, r.rank) == ("org/model-a", "acme", 2, 1)
    assert b"secret-salt" not in raw  # the salt is a secret: never written
    assert NamespaceRecord.from_bytes(NS.id, NamespaceRecord.of(NS, None).to_bytes()).tenant is None  # type: ignore[union-attr]


def _body(**change: object) -> bytes:
    body = json.loads(NamespaceRecord.of(NS, "acme").to_bytes())
    body.update(change)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b"not json",
        _body(v=2),
        _body(id="00" * 16),  # filed under another id than it names
        _body(model=7),
        _body(rank="1"),
        _body(rank=True),
        _body(tenant="a b"),
        _body(tenant=""),
        b" " * (MAX_RECORD_BYTES + 1),
    ],
)
def test_malformed_records_are_skipped(raw: bytes) -> None:
    assert NamespaceRecord.from_bytes(NS.id, raw) is None
    records, skipped = parse_records({NS.id: raw})
    assert (records, skipped) == ([], 1)


def test_the_control_a_well_formed_record_is_taken() -> None:
    records, skipped = parse_records({NS.id: _body()})
    assert skipped == 0 and [r.tenant for r in records] == ["acme"]


def test_namespace_of_takes_only_an_id_spelled_canonically() -> None:
    assert namespace_of(NS.id.hex()) == NS.id
    for text in (NS.id.hex().upper(), NS.id.hex()[:-2], NS.id.hex() + "00", "zz" * 16, ""):
        assert namespace_of(text) is None, text


def test_a_model_name_too_long_for_a_record_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match="namespace record"):
        NamespaceRecord.of(KeyNamespace(model="m" * MAX_RECORD_BYTES), None).to_bytes()


class _Tier:
    def __init__(self, name: str, fail: bool) -> None:
        self.name, self.fail, self.got = name, fail, None

    def record_namespace(self, namespace: bytes, record: bytes) -> None:
        if self.fail:
            raise OSError("read-only file system")
        self.got = (namespace, record)


def test_a_tier_that_cannot_record_is_logged_and_the_others_still_get_it(caplog: pytest.LogCaptureFixture) -> None:
    tiers = [_Tier("bad", True), _Tier("good", False), _Tier("not-written", False)]
    r = NamespaceRecord.of(NS, "acme")
    with caplog.at_level(logging.WARNING, logger="lmcache_core.namespaces"):
        record_in_tiers(tiers, [True, True, False], r)
    assert tiers[1].got == (NS.id, r.to_bytes())
    assert tiers[2].got is None  # an engine that does not write a tier leaves no record there
    assert "tier bad: could not record key namespace" in caplog.text and "read-only" in caplog.text


@pytest.mark.parametrize("label", ["a b", "", "x" * 65, "é"])
def test_a_tenant_label_is_a_plain_name(label: str) -> None:
    from lmcache_core.config import load_config

    with pytest.raises(ConfigError, match="tenant"):
        load_config(env={}, overrides={"tenant": label})
    assert CoreConfig(tenant="acme-1.prod_2").tenant == "acme-1.prod_2"  # the control
