"""What routing a request does to the EPP's per-pod state and cost model, shared by the server and the
simulator. Pure.

- `begin`: the request joins the chosen endpoint's prefill backlog (its uncached prompt work)
  until its first token. A request whose first byte will be its first token (`observable`:
  streamed, with a streamed response body) waits for it, at most 4x its estimated TTFT + 0.5 s
  (a lost stream cannot hold the backlog); any other leaves the backlog when its estimated TTFT
  has passed (its first byte comes with the whole answer).
- `first_token`: out of the backlog, now decoding; an observable, successful first token of the
  primary also calibrates the cost model.
- The end of the response releases the ticket (`Datastore.release`).
"""

from __future__ import annotations

from epp.costmodel.service import CostModel
from epp.datastore import Datastore, Ticket
from epp.types import Decision, InferenceRequest

FIRST_TOKEN_DEADLINE_FACTOR = 4.0
FIRST_TOKEN_DEADLINE_FLOOR = 0.5


def begin(
    datastore: Datastore,
    request: InferenceRequest,
    decision: Decision,
    now: float,
    observable: bool,
    cost: CostModel | None = None,
) -> Ticket:
    est = decision.estimates.get(decision.primary)
    if est is None:
        # A profile without the TTFT estimate (e.g. Dynamo's cost, which counts prefill load): the whole
        # prompt is the request's prefill work, and the cost model (if any) times its deadline.
        n = request.prompt_tokens_estimate
        if cost is None or n <= 0:
            return datastore.begin(decision.primary, n)
        profile = cost.profile(request.model)
        ttft = profile.prefill_s(n)
        deadline = now + (
            FIRST_TOKEN_DEADLINE_FACTOR * ttft + FIRST_TOKEN_DEADLINE_FLOOR if observable else ttft
        )
        return datastore.begin(decision.primary, n, profile.work(n, 0), deadline)
    if observable:
        deadline = now + FIRST_TOKEN_DEADLINE_FACTOR * est.ttft_s + FIRST_TOKEN_DEADLINE_FLOOR
    else:
        deadline = now + est.ttft_s
    return datastore.begin(decision.primary, est.prompt_tokens, est.work, deadline)


def first_token(
    datastore: Datastore,
    cost: CostModel | None,
    request: InferenceRequest,
    decision: Decision,
    ticket: Ticket,
    elapsed: float,
    calibrate: bool,
) -> None:
    """The first response byte arrived `elapsed` seconds after the pick. `calibrate`: it is the first
    token, of a successful response, from the primary endpoint."""
    datastore.first_token(ticket)
    est = decision.estimates.get(decision.primary)
    if cost is not None and est is not None and calibrate:
        cost.observe(request.model, est, elapsed)
