"""Envoy ext_proc stream handling: one gRPC stream per HTTP request.

Request path: headers are held until the body ends (FULL_DUPLEX_STREAMED) or answered at once
(BUFFERED, BUFFERED_PARTIAL / header-only); at the end of the body the request is scheduled and the
destination is returned as a header and as `envoy.lb` dynamic metadata. A BUFFERED_PARTIAL body that
comes without its end filled Envoy's buffer: it is refused with 413, naming that limit. A request with a
body in `request_body_mode` STREAMED or NONE is refused at its headers (`unsupported_mode`): Envoy routes
on the headers' answer there, before the EPP has read any body, so the pick could not reach it.
Response path: `ext_proc_response.ResponseSide` (the body echoed while usage, the first byte and errors
are recorded; the request released at the end, on error, or when the stream goes away).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.requests import RequestError
from epp.scheduling.errors import NoEndpointsError, SchedulingError, SloExceededError
from epp.server.body_budget import BodyBudget
from epp.server.director import Director, ParsedRequest, RoutedRequest
from epp.server.ext_proc_response import DUPLEX as _DUPLEX
from epp.server.ext_proc_response import ResponseSide
from epp.server.ext_proc_wire import (
    MAX_CHUNK,
    REQUEST_ID_HEADER,
    SubsetHint,
    destination_mutation,
    echo,
    error_response,
    header_map,
    lb_metadata,
    subset_hint,
)
from epp.usage import UsageReader

log = logging.getLogger("epp.ext_proc")

# After the response's last answer: how long to wait for Envoy to reset the stream before ending it
# with an OK status (`ExtProcService.Process`).
END_GRACE_S = 0.25
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"

_STREAMED = 1
_BUFFERED_PARTIAL = 3
# Request body modes in which Envoy passes the request headers on to the router as soon as they are
# answered, before (STREAMED) or without (NONE) sending the body: the pick, made from the body, would
# come too late, and the request would go to no endpoint or to a destination header the client sent.
_ROUTES_ON_HEADERS = {0: "NONE", _STREAMED: "STREAMED"}


def unsupported_mode(mode: int) -> str:
    return (
        f"request_body_mode {_ROUTES_ON_HEADERS[mode]} is not supported: Envoy routes on the answer to the "
        "request headers, before the EPP has read the body its pick needs; configure FULL_DUPLEX_STREAMED "
        "(Envoy Gateway's default) or BUFFERED"
    )


def partial_body(received: int) -> str:
    """Why a BUFFERED_PARTIAL body that came without its end is refused (`RequestStream._request_body`)."""
    return (
        f"request body exceeds Envoy's buffer limit under request_body_mode BUFFERED_PARTIAL (Envoy sent its "
        f"first {received} bytes without the body's end, and would pass the rest on unread, so the pick "
        "cannot be made from the body): raise Envoy's buffer limit (the listener's "
        "per_connection_buffer_limit_bytes) or configure FULL_DUPLEX_STREAMED"
    )


@dataclass(frozen=True, slots=True)
class _Pending:
    """A request whose routing waits for its prompt's tokens (`RequestStream.resume`)."""

    parsed: ParsedRequest
    body: bytearray | None
    header_phase: bool
    body_eos: bool
    trailers: bool  # it came with request trailers: answer them after the routing answer


class RequestStream(ResponseSide):
    """State machine for one ext_proc stream. `on_message` returns the responses to send."""

    def __init__(self, director: Director, max_body_bytes: int, budget: BodyBudget | None = None) -> None:
        self.director = director
        self.max_body_bytes = max_body_bytes
        self.budget = budget  # shared by every stream: the bytes all bodies may hold at once
        self.held = 0  # bytes of `body` reserved in `budget`
        self.headers: dict[str, str] = {}
        self.seen_headers = False
        self.received_at = 0.0  # when the request headers came (the request duration starts there)
        self.subset: SubsetHint | None = None
        self.request_mode = _DUPLEX
        self.response_mode = _DUPLEX
        self.body = bytearray()
        self.routed: RoutedRequest | None = None
        self.pending: _Pending | None = None  # parsed, its prompt being tokenized in the worker thread
        self.usage: UsageReader | None = None
        self.response_bytes = 0  # of the response body Envoy sent (response body modes other than NONE)
        self.done = False
        self.expired = False  # its body did not complete in time (`expire_body`): refused, budget given back
        self.timeout = 0.0  # the body's deadline it missed (seconds), once expired

    # -- request path -------------------------------------------------------------------
    def on_message(self, msg: pb.ProcessingRequest) -> Iterable[pb.ProcessingResponse]:
        which = msg.WhichOneof("request")
        if which == "request_headers":
            if self.seen_headers:
                return self._reject(400, "ProtocolError", "ext_proc: request headers sent twice")
            return self._request_headers(msg)
        if which in ("request_body", "request_trailers") and not self.seen_headers:
            return self._reject(400, "ProtocolError", f"ext_proc: {which} before the request headers")
        if self.expired and which in ("request_body", "request_trailers"):
            self.done = True  # (counted when it expired)
            return (error_response(408, "RequestTimeout", self._expired_message()),)
        if which == "request_body":
            return self._request_body(msg.request_body)
        if which == "request_trailers":
            return self._request_trailers()
        if which == "response_headers":
            return self._response_headers(msg)
        if which == "response_body":
            return self._response_body(msg.response_body)
        if which == "response_trailers":
            self._finish(self._end_cause())
            self.done = True
            return (pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),)
        return ()

    def _request_headers(self, msg: pb.ProcessingRequest) -> Iterable[pb.ProcessingResponse]:
        self.seen_headers = True
        self.received_at = self.director.clock.now()
        if msg.HasField("protocol_config"):
            self.request_mode = msg.protocol_config.request_body_mode
            self.response_mode = msg.protocol_config.response_body_mode
        self.headers = header_map(msg.request_headers)
        self.subset = subset_hint(msg)
        if self.subset is not None and self.subset.malformed:
            self.director.subset_malformed(self.subset.malformed)
        if msg.request_headers.end_of_stream:
            return self._route(None, header_phase=True)
        if self.request_mode in _ROUTES_ON_HEADERS:
            # Refused rather than routed past the EPP (this answer cannot carry the pick yet).
            return self._reject(500, "Internal", unsupported_mode(self.request_mode))
        if self.request_mode != _DUPLEX:
            # BUFFERED: Envoy waits for this answer before sending the body, and holds the headers
            # until the body's answer (which carries the destination).
            return (pb.ProcessingResponse(request_headers=pb.HeadersResponse()),)
        return ()

    def _request_body(self, body: pb.HttpBody) -> Iterable[pb.ProcessingResponse]:
        if self.routed is not None:  # body after a header-only pick: pass through
            return (
                (echo(body.body, body.end_of_stream, False),)
                if self.request_mode == _DUPLEX
                else (pb.ProcessingResponse(request_body=pb.BodyResponse()),)
            )
        if self.request_mode == _BUFFERED_PARTIAL and not body.end_of_stream:
            # Envoy sends a BUFFERED_PARTIAL body once, without its end only when it filled Envoy's buffer:
            # parsing that prefix would blame the client for a body cut short ("truncated", 400).
            return self._reject(413, "PayloadTooLarge", partial_body(len(self.body) + len(body.body)))
        if len(self.body) + len(body.body) > self.max_body_bytes:
            return self._reject(413, "PayloadTooLarge", f"request body exceeds {self.max_body_bytes} bytes")
        if self.budget is not None:
            if not self.budget.take(len(body.body)):
                cap = self.budget.limit // (1024 * 1024)
                return self._reject(
                    503,
                    "ServiceUnavailable",
                    f"the EPP holds {cap} MiB of request bodies (--max-buffered-body-size): retry shortly",
                    1,
                )
            self.held += len(body.body)
        self.body += body.body
        if self.request_mode == _DUPLEX and not body.end_of_stream:
            return ()
        return self._route(self.body, header_phase=False)

    def _request_trailers(self) -> Iterable[pb.ProcessingResponse]:
        out: list[pb.ProcessingResponse] = []
        if self.routed is None and not self.done:
            out.extend(self._route(self.body, header_phase=False, body_eos=False, trailers=True))
            if self.pending is not None:
                return out  # the trailers are answered after the routing answer (`resume`)
        if not self.done:
            out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        return out

    def _route(
        self, body: bytearray | None, header_phase: bool, body_eos: bool = True, trailers: bool = False
    ) -> Iterable[pb.ProcessingResponse]:
        """Parse and route the request. A body that ended empty is no body: Envoy sends the end of a
        request on its own when its headers did not carry it (HTTP/1.1 `transfer-encoding: chunked` with
        a zero-length body, an HTTP/2 request ending with an empty DATA frame), and that request is the
        same as one whose headers ended it, so it is parsed as header-only; its answer keeps the shape the
        mode asks of a body's end (`_answer`: in duplex mode the held headers' answer and the empty body
        echoed with its end of stream, in BUFFERED mode the body's answer)."""
        try:
            parsed = self.director.parse(self.headers, body or None)
        except RequestError as err:
            return self._reject(err.status, err.code, err.message)
        except Exception:
            log.exception("internal error while routing")
            return self._reject(500, "Internal", "internal error")
        tokenizing = self.director.tokenizing
        if tokenizing is not None:
            now = tokenizing.plan(parsed.request)
            if now is None:
                # a long prompt: tokenized in the worker thread, then routed (`resume`, from `Process`)
                try:
                    self.director.precheck(parsed, self._allowed())  # refused anyway: not worth tokenizing
                except SchedulingError as err:
                    return self._refuse(err, parsed)
                except Exception:
                    log.exception("internal error while routing")
                    return self._reject(500, "Internal", "internal error", parsed=parsed)
                self.pending = _Pending(parsed, body, header_phase, body_eos, trailers)
                return ()
            parsed = dataclasses.replace(parsed, request=now)
        return self._answer(parsed, body, header_phase, body_eos)

    async def resume(self) -> Iterable[pb.ProcessingResponse]:
        """Route the request `_route` left pending, once its prompt is tokenized in the worker thread."""
        p = self.pending  # (left set while it is tokenized: its body is complete, not awaited)
        assert p is not None and self.director.tokenizing is not None
        try:
            request = await self.director.tokenizing.tokenize(p.parsed.request)
        except Exception:
            self.pending = None
            log.exception("internal error while tokenizing")
            return self._reject(500, "Internal", "internal error", parsed=p.parsed)
        self.pending = None
        parsed = dataclasses.replace(p.parsed, request=request)
        out = list(self._answer(parsed, p.body, p.header_phase, p.body_eos))
        if p.trailers and not self.done:
            out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        return out

    def _answer(
        self, parsed: ParsedRequest, body: bytearray | None, header_phase: bool, body_eos: bool
    ) -> Iterable[pb.ProcessingResponse]:
        try:
            streamed = self.response_mode in (_DUPLEX, _STREAMED)
            routed = self.director.route_parsed(parsed, self._allowed(), streamed, self.received_at)
        except SchedulingError as err:
            return self._refuse(err, parsed)
        except Exception:
            log.exception("internal error while routing")
            return self._reject(500, "Internal", "internal error", parsed=parsed)
        self.routed = routed
        dest = ",".join(routed.decision.endpoints)
        metadata = lb_metadata(dest)
        new_body, routed.body = routed.body, None  # sent below; not kept for the response's lifetime
        # A request that came without an x-request-id gets the one the EPP generated (epp/requests.py), as
        # in the reference (llm-d/llm-d-router pkg/epp/handlers/server.go, request.go `generateHeaders`).
        request = routed.request
        generated = None if request.headers.get(REQUEST_ID_HEADER) else request.request_id
        common = destination_mutation(dest, None if new_body is None else len(new_body), generated)
        if header_phase:
            return (
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
                ),
            )
        if self.request_mode != _DUPLEX:
            self._drop_body()  # routed: Envoy has the body (or gets the new one below)
            if new_body is not None:
                common.body_mutation.body = new_body
            return (
                pb.ProcessingResponse(
                    request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
                ),
            )
        out = [
            pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        ]
        assert body is not None
        data = bytes(body) if new_body is None else new_body
        self._drop_body()
        n = len(data)
        if n == 0:
            out.append(echo(b"", body_eos, False))
        for start in range(0, n, MAX_CHUNK):
            end = start + MAX_CHUNK
            out.append(echo(data[start:end], body_eos and end >= n, False))
        return out

    def _allowed(self) -> frozenset[str] | None:
        return None if self.subset is None else self.subset.allowed

    def _refuse(self, err: SchedulingError, parsed: ParsedRequest) -> Iterable[pb.ProcessingResponse]:
        retry_after = err.retry_after_s if isinstance(err, SloExceededError) else None
        message = str(err)
        if isinstance(err, NoEndpointsError) and self.subset is not None and self.subset.malformed:
            shown = ", ".join(repr(e) for e in self.subset.malformed[:5])
            more = len(self.subset.malformed) - 5
            message += f" (entries that are neither ip:port nor an IP, ignored: {shown}"
            message += f" and {more} more)" if more > 0 else ")"
        return self._reject(err.status, err.code, message, retry_after, parsed)

    @property
    def awaiting_body(self) -> bool:
        """The request's headers came and its body has not been routed yet (nor refused)."""
        return self.seen_headers and self.routed is None and self.pending is None and not self.done

    def expire_body(self, timeout: float) -> None:
        """The body did not complete within `timeout` seconds of the headers (`--request-body-timeout`):
        what it holds goes back to the shared budget now (a client trickling bodies cannot hold it), the
        refusal is counted, and the stream's next request message is answered 408."""
        if not self.awaiting_body or self.expired:
            return
        self.expired = True
        self.timeout = timeout
        self._drop_body()
        self.director.reject(408, "RequestTimeout")

    def _expired_message(self) -> str:
        return f"the request body did not complete within {self.timeout:g}s (--request-body-timeout)"

    def _drop_body(self) -> None:
        self.body = bytearray()
        if self.held and self.budget is not None:
            self.budget.give(self.held)
        self.held = 0

    def _reject(
        self,
        status: int,
        code: str,
        message: str,
        retry_after: int | None = None,
        parsed: ParsedRequest | None = None,
    ) -> Iterable[pb.ProcessingResponse]:
        """Answer the request from the EPP; `parsed`: its body had been read (its model is known)."""
        self.done = True
        self._drop_body()
        self.director.reject(status, code, parsed)
        return (error_response(status, code, message, retry_after),)

    # -- response path ------------------------------------------------------------------
    def close(self) -> None:
        """The stream ended: release whatever is still held (client gone, Envoy reset)."""
        self._drop_body()
        if self.routed is not None:
            self._finish(self._close_cause(), ended=False)


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        director: Director,
        max_body_bytes: int,
        budget: BodyBudget | None = None,
        body_timeout: float = 0.0,
    ) -> None:
        self.director = director
        self.max_body_bytes = max_body_bytes
        self.budget = budget
        self.body_timeout = body_timeout  # seconds from the headers for the body to complete; 0: no limit

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = RequestStream(self.director, self.max_body_bytes, self.budget)
        timer: asyncio.TimerHandle | None = None
        try:
            async for msg in request_iterator:
                for resp in stream.on_message(msg):
                    yield resp
                if timer is None and self.body_timeout > 0 and stream.awaiting_body:
                    # A timer, not a read with a deadline: cancelling a read leaks grpcio's native ops.
                    timer = asyncio.get_running_loop().call_later(
                        self.body_timeout, stream.expire_body, self.body_timeout
                    )
                if stream.pending is not None:
                    for resp in await stream.resume():
                        yield resp
                if stream.done:
                    # Envoy resets the stream once it has the last answer. The reset must find no gRPC
                    # batch of ours in flight: grpcio's aio server leaks the native ops of a read
                    # cancelled by it, and of a status sent into it (docs/operations.md, "Memory").
                    # So wait here, reading nothing, to be cancelled; a client that does not reset
                    # gets its OK status after END_GRACE_S.
                    await asyncio.sleep(END_GRACE_S)
                    return
        finally:
            if timer is not None:
                timer.cancel()
            stream.close()
