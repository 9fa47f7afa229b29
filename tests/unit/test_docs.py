"""The references in docs/ cannot drift from the code: every plugin and metric is documented."""

from __future__ import annotations

import pathlib

from prometheus_client import CollectorRegistry

from epp.costmodel.service import CostModel
from epp.datastore import Datastore
from epp.scheduling.builtin import default_registry
from epp.server.metrics import EppMetrics
from epp.testing.fakes import FakeClock

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def test_every_plugin_type_is_in_the_configuration_reference() -> None:
    text = (DOCS / "configuration.md").read_text()
    missing = [s.type_name for s in default_registry().types() if f"`{s.type_name}`" not in text]
    assert missing == []


def test_every_metric_is_in_the_metrics_reference() -> None:
    metrics = EppMetrics(CollectorRegistry())
    metrics.attach_pool(Datastore(FakeClock()), FakeClock(), "p")
    cost = CostModel()
    cost.calibrator("m")  # a model seen, so its series exist
    metrics.attach_cost_model(cost)
    names = {m.name for m in metrics.registry.collect()}
    assert "epp_cost_model_prefill_scale" in names
    text = (DOCS / "metrics.md").read_text()
    documented = {n for n in names if f"`{n}`" in text or f"`{n}_total`" in text}
    assert names - documented == set()
