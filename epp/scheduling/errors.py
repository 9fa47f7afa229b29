"""Scheduling outcomes that are not a pick. The edge maps each to an HTTP status."""

from __future__ import annotations


class SchedulingError(Exception):
    """Base class; `status` is the HTTP status the gateway should answer with."""

    status = 500
    code = "Internal"


class NoEndpointsError(SchedulingError):
    """The pool (or the subset the gateway allowed) has no usable endpoint."""

    status = 503
    code = "ServiceUnavailable"


class AllFilteredError(SchedulingError):
    """Every candidate was removed by a filter."""

    status = 429
    code = "InferencePoolResourceExhausted"


class PoolSaturatedError(SchedulingError):
    """A sheddable request met a saturated pool."""

    status = 429
    code = "InferencePoolResourceExhausted"


class SloExceededError(SchedulingError):
    """A sheddable request whose fastest estimated time to first token is over the SLO."""

    status = 429
    code = "InferencePoolResourceExhausted"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
