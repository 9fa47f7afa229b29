"""Figures computed at scrape time: no made-up age for a never-scraped endpoint, and calibration
observation kinds that add up."""

from __future__ import annotations

from epp.costmodel.service import CostModel
from epp.datastore import Datastore
from epp.server.metrics import EppMetrics
from epp.testing.fakes import FakeClock
from epp.types import MetricsSnapshot

AGE = "epp_endpoint_metrics_age_seconds"


def test_an_endpoint_has_no_metrics_age_until_its_first_successful_scrape() -> None:
    clock = FakeClock()
    ds = Datastore(clock)
    ds.add_endpoint("10.0.0.1:80")
    m = EppMetrics()
    m.attach_pool(ds, clock, "pool")
    assert m.registry.get_sample_value(AGE, {"endpoint": "10.0.0.1:80"}) is None
    ds.record_scrape_failure("10.0.0.1:80", "timeout")
    assert m.registry.get_sample_value(AGE, {"endpoint": "10.0.0.1:80"}) is None
    ds.record_metrics("10.0.0.1:80", MetricsSnapshot(observed_at=clock.now()))
    clock.advance(1.5)
    assert m.registry.get_sample_value(AGE, {"endpoint": "10.0.0.1:80"}) == 1.5
    # the endpoint's other gauges were there all along
    assert m.registry.get_sample_value("epp_endpoint_healthy", {"endpoint": "10.0.0.1:80"}) is not None


class _Calibrated(CostModel):
    """A cost model whose calibration is given (the fit itself is tested in test_calibration)."""

    def coefficients(self) -> dict[str, dict[str, float]]:
        return {
            "m": {
                "prefill_scale": 1.0,
                "queue_scale": 1.0,
                "prefill_seconds_per_token": 1e-4,
                "observations": 10,  # the calibrator's count: the clipped outliers are among them
                "outliers": 3,
                "ignored": 2,
            }
        }


def test_calibration_observation_kinds_are_disjoint() -> None:
    m = EppMetrics()
    m.attach_cost_model(_Calibrated())
    kinds = {
        kind: m.registry.get_sample_value(
            "epp_cost_model_observations_total", {"model_name": "m", "kind": kind}
        )
        for kind in ("used", "outlier", "ignored")
    }
    assert kinds == {"used": 7, "outlier": 3, "ignored": 2}
    assert sum(v or 0 for v in kinds.values()) == 10 + 2  # every observation once


def test_only_counters_incremented_as_things_happen_have_created_series() -> None:
    """As docs/metrics.md says: the scrape-time counters (KV index, cost model, tokenizing worker) have
    no `_created` series; the others do, once they have a series."""
    from prometheus_client import generate_latest

    from epp.config import default_config
    from epp.server.app import EppServer, ServerSettings

    server = EppServer(ServerSettings(secure_serving=False, refresh_metrics_interval=0), default_config())
    server.metrics.accounting_errors.inc()
    server.metrics.pick_modes("cache-aware").inc()
    text = generate_latest(server.metrics.registry).decode()
    created = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if "_created" in line[:80]}
    assert {"epp_response_accounting_errors_created", "epp_pick_mode_created"} <= created
    scrape_time = ("epp_kv_", "epp_cost_model_observations", "epp_prompts_tokenized_in_worker")
    assert not [name for name in created if name.startswith(scrape_time)]
    assert "epp_kv_socket_errors_total{" in text  # (they are there, without `_created`)
