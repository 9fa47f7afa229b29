"""The request lifecycle, independent of the wire protocol: validate, schedule, account, release.

Per-endpoint figures of a response (time to first byte, usage, backend errors) and its in-flight
accounting belong to the endpoint that served it: Envoy's report (`served`) when it names one of
the decision's endpoints (it fell back), else the primary.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from epp import accounting
from epp.clock import Clock
from epp.costmodel.service import CostModel
from epp.datastore import Datastore, Ticket
from epp.discovery.rewrites import EMPTY as NO_REWRITES
from epp.discovery.rewrites import RewriteTable
from epp.requests import (
    GIE_MODEL_REWRITE_HEADER,
    MODEL_REWRITE_HEADER,
    RequestError,
    build_request,
    parse_body,
)
from epp.scheduling.errors import NoEndpointsError
from epp.scheduling.scheduler import Scheduler
from epp.server.decisions import DecisionLog
from epp.server.metrics import EppMetrics
from epp.server.model_labels import MAX_MODEL_LABELS, OTHER_MODEL, ModelLabels
from epp.server.tokenizing import PromptTokenizing
from epp.tenancy import TenantSalter
from epp.types import NO_WORK, Decision, Endpoint, InferenceRequest, TtftEstimate
from epp.usage import Usage

log = logging.getLogger("epp.director")

MODEL_SERVER_ERROR = "ModelServerError"
"""The request errors' `error_code` of a model server's error, whatever its status (the reference's
`errutil.ModelServerError`); the status is in `epp_backend_errors_total`, a stream error event's code in
`epp_stream_errors_total`."""
FAILURE_LOG_EVERY_S = 30.0
"""Bookkeeping failures on the response path are logged at most this often (all are counted)."""
# The rewrite header names the model the request goes to the model server as: the body's `model` is
# rewritten to it, and the request is scheduled for it (the reference: llm-d/llm-d-router
# pkg/epp/handlers/request.go reads it, pkg/epp/requestcontrol/director.go `modelRewriteIfNeeded` rewrites
# the body). It is MODEL_REWRITE_HEADER (llm-d's name, llm-d/llm-d-router pkg/epp/metadata/consts.go) or
# GIE_MODEL_REWRITE_HEADER (kubernetes-sigs/gateway-api-inference-extension pkg/epp/metadata/consts.go);
# llm-d's wins when both are sent, even with an empty value, as the reference's `GetLowerCaseHeaderValue`
# has it. A matching InferenceModelRewrite rule takes precedence over either (`Director.model_rewrites`).
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    request: InferenceRequest
    new_body: bytes | None  # the body to forward when the EPP changed it (tenant salt, model rewrite)
    incoming_model: str | None = None  # the client's model when the rewrite header or a rule replaced it


@dataclass(slots=True)
class RoutedRequest:
    request: InferenceRequest
    decision: Decision
    ticket: Ticket
    routed_at: float
    received_at: float  # when its request headers reached the EPP (`inference_objective_request_duration`)
    status: int | None = None
    first_byte_at: float | None = None
    body: bytes | None = None  # the body to forward when the EPP changed it (tenant salt, model rewrite)
    incoming_model: str | None = None  # the client's model when the rewrite header or a rule replaced it
    # (model_name, target_model_name) of its request metrics, taken once when it was routed: a name's
    # label may change while it is in flight (a pod that serves it appears), the running gauge must not
    labels: tuple[str, str] = (OTHER_MODEL, OTHER_MODEL)
    observable: bool = False  # its first response byte will be its first token (streamed both ways)
    served: str | None = None  # the endpoint Envoy reports it used, when it says
    stream_error: str | None = None  # a 2xx stream's error event, as its `error_code` (`on_stream_error`)

    @property
    def estimate(self) -> TtftEstimate | None:
        return self.decision.estimates.get(self.decision.primary)

    @property
    def endpoint(self) -> str:
        """The endpoint that served the response: Envoy's report when it names one of the decision's
        endpoints, else the primary."""
        served = self.served
        if served is not None and served in self.decision.endpoints:
            return served
        return self.decision.primary


class Director:
    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        metrics: EppMetrics,
        clock: Clock,
        objectives: Mapping[str, int] | None = None,
        cost: CostModel | None = None,
        tenancy: TenantSalter | None = None,
        decisions: DecisionLog | None = None,
        decision_header: bool = False,
        tokenizing: PromptTokenizing | None = None,
        rewrite_rng: random.Random | None = None,
    ) -> None:
        self.datastore = datastore
        self.scheduler = scheduler
        self.metrics = metrics
        self.clock = clock
        self.objectives = dict(objectives or {})
        self.cost = cost
        self.tenancy = tenancy
        self.decisions = decisions
        self.decision_header = decision_header
        self.tokenizing = tokenizing  # long prompts tokenized in a worker thread between parse and route
        # The request metrics' model labels, bounded (`model_labels`); the names the rewrite rules name are
        # the operator's, as are served models and objectives.
        self.labels = ModelLabels(self._known_model)
        self._rule_models: frozenset[str] = frozenset()
        # InferenceModelRewrite rules in force (set by the rewrite watcher), the generator of their
        # weighted picks, and the decisions taken: (model_rewrite_name, model_name, target_model) -> count,
        # the labels of the reference's model_rewrite_decisions_total (model names bounded by `labels`).
        self._model_rewrites: RewriteTable = NO_REWRITES
        self.rewrite_rng = rewrite_rng if rewrite_rng is not None else random.Random()
        self.rewrite_decisions: Counter[tuple[str, str, str]] = Counter()
        self._failure_logged_at = -math.inf
        self._failures_unlogged = 0
        self._subset_logged_at = -math.inf
        self._subsets_unlogged = 0

    @property
    def model_rewrites(self) -> RewriteTable:
        return self._model_rewrites

    @model_rewrites.setter
    def model_rewrites(self, table: RewriteTable) -> None:
        """New rules: the names and (model, target) pairs they name get their own metric labels."""
        self._model_rewrites = table
        rules = [*table.exact.values(), *([table.generic] if table.generic is not None else [])]
        targets = {t.model for rule in rules for t in rule.targets}
        self._rule_models = frozenset(table.exact) | targets
        self.labels.set_rule_pairs(
            {(model, t.model) for model, rule in table.exact.items() for t in rule.targets}
        )

    def _known_model(self, name: str) -> bool:
        """A name the operator put there (never spends a label slot): an objective's, one the rewrite
        rules name, one the pool serves."""
        return name in self.objectives or name in self._rule_models or name in self.datastore.served_models()

    def model_labels(self, request: InferenceRequest, incoming_model: str | None) -> tuple[str, str]:
        """The request metrics' (model_name, target_model_name), as the reference has them: the client's
        model and the one it goes to the model server as (they differ when the rewrite header rewrites)."""
        target = request.model
        return self.labels.pair(target if incoming_model is None else incoming_model, target)

    def route(
        self,
        headers: Mapping[str, str],
        body: bytes | bytearray | None,
        subset: Collection[str] | None = None,
        streamed_response: bool = True,
    ) -> RoutedRequest:
        """Pick endpoints for a request. Raises RequestError or SchedulingError. `streamed_response`:
        Envoy passes the response body on as it comes (so the first body byte is the first token
        of a streamed request)."""
        received_at = self.clock.now()
        return self.route_parsed(self.parse(headers, body), subset, streamed_response, received_at)

    def parse(self, headers: Mapping[str, str], body: bytes | bytearray | None) -> ParsedRequest:
        """The first half of `route`: validate the request (raises RequestError) and apply the tenant's
        salt. Between the halves the server may tokenize the prompt in a worker thread."""
        doc: dict[str, Any] | None = None if body is None else parse_body(body)
        new_body: bytes | None = None
        incoming, decision = (None, None) if doc is None else self._rewrite_model(headers, doc)
        if self.tenancy is not None:  # the tenant's salt replaces any client-sent cache_salt
            if doc is not None:
                new_body = self.tenancy.apply(headers, doc)
            else:
                self.tenancy.tenant_of(headers)  # a header-only request still needs a tenant
        if incoming is not None and new_body is None:
            new_body = _encoder.encode(doc)
        model = doc.get("model") if doc is not None else None
        # SGLang's `<base>:<adapter>` (`requests.sglang_adapter`) against every name the pool serves
        served = self.datastore.served_models() if isinstance(model, str) and ":" in model else ()
        request = build_request(
            headers, doc, self.objectives, len(body) if body is not None else 0, served_models=served
        )
        if decision is not None:  # counted once the request is taken (not for one refused with 400/403)
            self.rewrite_decisions[decision] += 1
            self.metrics.model_rewrites(*decision).inc()
        return ParsedRequest(request, new_body, incoming)

    def _rewrite_model(
        self, headers: Mapping[str, str], doc: dict[str, Any]
    ) -> tuple[str | None, tuple[str, str, str] | None]:
        """Rewrite the body's `model`: returns the client's model when it was replaced, and the
        InferenceModelRewrite decision to count (its metric labels) when a rule picked the target. The
        InferenceModelRewrite rule for the client's model, when there is one, picks the target and takes
        precedence over the rewrite header, as in the reference (llm-d/llm-d-router
        pkg/epp/requestcontrol/director.go: `applyWeightedModelRewrite` runs after the header set the
        target); else the header does."""
        target = _header_target(headers, doc)
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            return None, None  # build_request refuses it (400)
        decision = None
        if self.model_rewrites:
            hit = self.model_rewrites.rewrite(model, self.rewrite_rng)
            if hit is not None:
                rule, target = hit
                decision = (rule.source, *self.labels.pair(model, target))
        if target is None or target == model:
            return None, decision
        doc["model"] = target
        return model, decision

    def route_parsed(
        self,
        parsed: ParsedRequest,
        subset: Collection[str] | None = None,
        streamed_response: bool = True,
        received_at: float | None = None,
    ) -> RoutedRequest:
        """The second half of `route`: schedule and account. Raises SchedulingError. `received_at`: when
        the request's headers reached the EPP (the request duration starts there, as in the reference;
        without it, at the scheduling cycle)."""
        request, new_body = parsed.request, parsed.new_body
        candidates = self._candidates(subset)
        t0 = self.clock.now()
        try:
            result = self.scheduler.schedule(request, candidates)
        finally:  # a cycle that refused the request (SchedulingError: 429, 503) is a cycle too
            t1 = self.clock.now()
            self.metrics.scheduler_duration.observe(t1 - t0)
        # Scheduled: its prompt (token ids, messages, chat options: up to ~15x the body once parsed) is not
        # kept for the response's lifetime; what accounting and metrics read stays.
        if request.tokens is not None or request.prompt is not None or request.messages is not None:
            request = dataclasses.replace(request, tokens=None, prompt=None, messages=None, chat=None)
        m = self.metrics
        for point, ptype, pname, seconds in result.timings:
            m.plugin_duration(point, ptype, pname).observe(seconds)
        decision = result.decision
        m.picks(decision.primary, decision.profile, decision.reason).inc()
        if decision.mode:
            m.pick_modes(decision.mode).inc()
        model, target = self.model_labels(request, parsed.incoming_model)
        m.requests(model, target).inc()
        m.request_sizes(model, target).observe(request.body_bytes)
        m.running(model).inc()
        observable = request.stream and streamed_response
        ticket = accounting.begin(self.datastore, request, decision, t1, observable, self.cost)
        if self.decisions is not None and self.decisions.keep:
            self.decisions.add(t1, request, decision, self._calibration_used(request.model, decision))
        return RoutedRequest(
            request,
            decision,
            ticket,
            t1,
            t0 if received_at is None else received_at,
            body=new_body,
            incoming_model=parsed.incoming_model,
            labels=(model, target),
            observable=observable,
        )

    def precheck(self, parsed: ParsedRequest, subset: Collection[str] | None = None) -> None:
        """Raise the SchedulingError that `route_parsed` would raise before any scorer runs (no endpoint,
        a sheddable request while the pool is saturated, the filters leaving none): checked before a
        prompt is tokenized ahead."""
        self.scheduler.precheck(parsed.request, self._candidates(subset), filters=True)

    def _candidates(self, subset: Collection[str] | None) -> list[Endpoint]:
        if subset is None:
            return self.datastore.candidates()
        candidates = self.datastore.candidates(subset)
        if not candidates:
            raise NoEndpointsError("no eligible endpoint in the gateway's subset hint")
        return candidates

    def subset_malformed(self, entries: Collection[str]) -> None:
        """The gateway's subset hint had entries that are neither `ip:port` nor an IP (they allow nothing):
        logged at most every FAILURE_LOG_EVERY_S, a misconfigured gateway sending them on every request."""
        now = self.clock.now()
        if now - self._subset_logged_at < FAILURE_LOG_EVERY_S:
            self._subsets_unlogged += 1
            return
        skipped, self._subsets_unlogged = self._subsets_unlogged, 0
        self._subset_logged_at = now
        log.warning(
            "the gateway's subset hint (envoy.lb.subset_hint) has entries that are neither ip:port nor an "
            "IP, ignored: %s (%d more requests with such entries since the last report)",
            ", ".join(repr(e) for e in entries),
            skipped,
        )

    def reject(self, status: int, code: str, parsed: ParsedRequest | None = None) -> None:
        """The EPP answers the request itself. Counted in the request errors too, under the request's
        model with the EPP's code (as the reference counts its errors), when its body had been read
        (`parsed`): one refused before that has no model to count it under."""
        self.metrics.rejections(str(status), code).inc()
        if parsed is not None:
            labels = self.model_labels(parsed.request, parsed.incoming_model)
            self.metrics.request_errors(*labels, code).inc()

    def _calibration_used(self, model: str, decision: Decision) -> dict[str, float]:
        """The cost model's coefficients this decision's estimates were computed with (none without
        estimates), kept with the decision for /debug/decisions."""
        if self.cost is None or not decision.estimates:
            return {}
        return self.cost.calibration_of(model)

    def on_served(self, routed: RoutedRequest, served: str | None) -> None:
        """Envoy reported the endpoint it sent the request to. When that is a fallback of the decision,
        the request's in-flight accounting moves there: the ticket taken on the primary is released
        (what was acquired) and one is taken on the served endpoint, in the same phase (prefill
        backlog with its estimate's work and the same deadline, or decoding)."""
        routed.served = served
        old = routed.ticket
        target = routed.endpoint
        if target == old.endpoint or old.released:
            return
        decoding = old.decoding
        est = routed.decision.estimates.get(target)
        work = NO_WORK if decoding else (est.work if est is not None else old.work)
        self.datastore.release(old)
        routed.ticket = self.datastore.begin(
            target, old.prompt_tokens, work, old.first_token_by if work.requests else math.inf
        )
        if decoding:
            self.datastore.first_token(routed.ticket)

    def on_response_status(self, routed: RoutedRequest, status: int) -> None:
        routed.status = status
        if not 200 <= status < 300:
            if self._in_pool(routed):
                self.metrics.backend_errors(routed.endpoint, str(status)).inc()
            self.metrics.request_errors(*routed.labels, MODEL_SERVER_ERROR).inc()

    def on_stream_error(self, routed: RoutedRequest, code: str) -> None:
        """A stream that started with a 2xx status carried an error event (`UsageReader.error`; vLLM and
        SGLang send `data: {"error": {...}}` once the 200 is out): counted once in the request errors as
        a non-2xx status is, and under `code` per endpoint; its end is then released as `error`, and its
        first token (if it comes after) calibrates nothing. A non-2xx response was counted by its status
        already."""
        if routed.stream_error is not None:
            return
        if routed.status is not None and not 200 <= routed.status < 300:
            return
        routed.stream_error = code
        self.metrics.request_errors(*routed.labels, MODEL_SERVER_ERROR).inc()
        if self._in_pool(routed):
            self.metrics.stream_errors(routed.endpoint, code).inc()

    def on_first_byte(self, routed: RoutedRequest) -> None:
        if routed.first_byte_at is not None:
            return
        routed.first_byte_at = now = self.clock.now()
        elapsed = now - routed.routed_at
        if self._in_pool(routed):
            self.metrics.ttfb(routed.endpoint).observe(elapsed)
        # Only a streamed, successful response's first byte is its first token, and only the
        # primary's estimate predicts it (Envoy may have fallen back to another endpoint).
        calibrate = (
            routed.observable
            and routed.status is not None
            and 200 <= routed.status < 300
            and routed.stream_error is None  # e.g. vLLM's role chunk sent with the error that follows it
            and routed.served in (None, routed.decision.primary)
        )
        accounting.first_token(
            self.datastore, self.cost, routed.request, routed.decision, routed.ticket, elapsed, calibrate
        )

    def finish(
        self,
        routed: RoutedRequest,
        cause: str,
        usage: Usage | None = None,
        usage_invalid: bool = False,
        response_bytes: int | None = None,
    ) -> None:
        """Release the request's in-flight accounting (idempotent). cause: complete|error|disconnect|
        unobserved (`error` also for a 2xx stream that carried an error event, whose usage, when it sent
        one, is recorded all the same: the tokens were spent; `unobserved`: the stream ended and Envoy
        sent nothing of the response, `RequestStream.close`). `usage_invalid`: the response's usage had an
        impossible count and was ignored. `response_bytes`: the response body's size, when Envoy sent the
        body (None under response_body_mode NONE)."""
        if not self.datastore.release(routed.ticket):
            return
        m = self.metrics
        model, target = routed.labels
        m.released(cause).inc()
        m.running(model).dec()
        duration = self.clock.now() - routed.received_at
        m.request_duration(model, target).observe(duration)
        if response_bytes is not None:
            m.response_sizes(model, target).observe(response_bytes)
        ep = routed.endpoint
        in_pool = self._in_pool(routed)
        if usage_invalid and in_pool:
            m.usage_invalid(ep).inc()
        if usage is not None:
            m.input_tokens(model, target).observe(usage.prompt_tokens)
            m.output_tokens(model, target).observe(usage.completion_tokens)
            if usage.completion_tokens > 0:  # (the reference's NTPOT: the whole duration per output token)
                m.ntpot(model, target).observe(duration / usage.completion_tokens)
        if usage is not None and in_pool:
            m.usage_tokens(ep, "prompt").inc(usage.prompt_tokens)
            m.usage_tokens(ep, "cached").inc(usage.cached_tokens)
            m.usage_tokens(ep, "completion").inc(usage.completion_tokens)

    def _in_pool(self, routed: RoutedRequest) -> bool:
        """Per-endpoint figures of a response that ends after its endpoint left the pool are dropped:
        its series were removed (`EppMetrics.forget_endpoint`) and must not come back for a stray, nor
        go to the endpoint's next incarnation (the same address added again since it was routed)."""
        rec = self.datastore.get(routed.endpoint)
        return rec is not None and rec.added_at <= routed.routed_at

    def bookkeeping_failed(self, where: str) -> None:
        """An unexpected exception in response-side bookkeeping (call from an `except` block): counted,
        and logged with its traceback at most every FAILURE_LOG_EVERY_S. The response goes on."""
        try:
            self.metrics.accounting_errors.inc()
            now = self.clock.now()
            if now - self._failure_logged_at < FAILURE_LOG_EVERY_S:
                self._failures_unlogged += 1
                return
            skipped, self._failures_unlogged = self._failures_unlogged, 0
            self._failure_logged_at = now
            log.exception(
                "response bookkeeping failed in %s; the response is passed on (%d similar failures "
                "since the last report)",
                where,
                skipped,
            )
        except Exception:  # never let reporting a failure fail the stream
            pass


def _header_target(headers: Mapping[str, str], doc: dict[str, Any]) -> str | None:
    """The model the rewrite header names (MODEL_REWRITE_HEADER, else GIE_MODEL_REWRITE_HEADER), or None. A
    body without a valid `model` is left for `build_request` to refuse (400); an empty header is no rewrite
    (as in the reference), and an empty llm-d header still shadows the other one (as there). A value with a
    comma is refused (400), naming the header it came in: the header sent more than once (`header_map` joins
    the copies), where the reference silently takes one copy."""
    name, value = MODEL_REWRITE_HEADER, headers.get(MODEL_REWRITE_HEADER)
    if value is None:
        name, value = GIE_MODEL_REWRITE_HEADER, headers.get(GIE_MODEL_REWRITE_HEADER)
    if not value:
        return None
    target = value.strip()
    model = doc.get("model")
    if not target or not isinstance(model, str) or not model:
        return None
    if "," in target:
        got = target[:64]
        raise RequestError(400, "BadRequest", f"header {name!r} must name one model, once (got {got!r})")
    return target


__all__ = ["MAX_MODEL_LABELS", "OTHER_MODEL", "Director", "RequestError", "RoutedRequest"]
