"""deploy/: the alert rules load, each alert fires on its condition and stays silent
otherwise (``promtool test rules``), and the dashboard and the rules read only
metrics lmcache-core exports (docs/metrics.md lists them all)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from .prom import MISSING, ROOT, RULE_TESTS, RULES, alert_rules, dashboard_queries, selectors

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=MISSING)


@needs_promtool
def test_rules_load_and_each_alert_fires_only_on_its_condition() -> None:
    ok = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in ok.stdout
    res = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    tested = RULE_TESTS.read_text()
    assert all(f"alertname: {r['alert']}" in tested for r in alert_rules()), "an alert without a promtool test"


@needs_promtool
def test_negative_control_a_wrong_threshold_fails_the_rule_tests(tmp_path: Path) -> None:
    """The rule tests can fail: the same tests against rules whose error threshold is
    far too high (the alert never fires) do."""
    broken = RULES.read_text().replace(
        "rate(lmcache_core:tier_errors_total[5m])) > 0.1", "rate(lmcache_core:tier_errors_total[5m])) > 100"
    )
    assert broken != RULES.read_text()
    (tmp_path / RULES.name).write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    res = subprocess.run(
        [PROMTOOL, "test", "rules", str(tmp_path / RULE_TESTS.name)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode != 0 and "LMCacheTierErrors" in res.stdout + res.stderr


def test_dashboard_and_rules_read_only_exported_metrics() -> None:
    """Every lmcache_core: name a panel or an alert reads is one the connector exports
    (its stats table) and docs/metrics.md documents; every exported one has a panel."""
    from lmcache_connector.protocol.stats import COUNTERS, TIER_COUNTERS, TIER_GAUGES

    exported = {f"lmcache_core:{name}_total" for name, _ in [*COUNTERS.values(), *TIER_COUNTERS.values()]}
    exported |= {f"lmcache_core:{name}" for name, _ in TIER_GAUGES.values()}
    read = set().union(*(selectors(e) for _, e in dashboard_queries()), *(selectors(r["expr"]) for r in alert_rules()))
    ours = {m for m in read if m.startswith("lmcache_core:")}
    assert ours - exported == set(), f"panels or alerts read metrics nobody exports: {ours - exported}"
    assert exported - ours == set(), f"exported metrics without a panel: {exported - ours}"
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert [m for m in sorted(exported) if f"`{m}" not in doc] == []
