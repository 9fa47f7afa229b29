"""The response half of an ext_proc stream (`ext_proc.RequestStream`): the response's headers and body
as Envoy sends them, and the routed request's release with its figures.

The body is echoed (duplex) while usage, the first byte and a stream's error event (`UsageReader`) are
recorded; the request's in-flight accounting is released at the response's end, on error, or when the
stream goes away (`_close_cause`). The response is the backend's: bookkeeping never fails it (an
unexpected error is counted and logged, and the response passed on).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.server.decisions import DECISION_HEADER, header_value
from epp.server.director import Director, RoutedRequest
from epp.server.ext_proc_wire import echo, header, header_map, served_endpoint
from epp.usage import UsageReader

DUPLEX: Final = 4  # ProcessingMode.FULL_DUPLEX_STREAMED


class ResponseSide:
    """A mixin: `RequestStream` provides the state."""

    director: Director
    routed: RoutedRequest | None
    usage: UsageReader | None
    response_bytes: int
    response_mode: int
    done: bool

    def _response_headers(self, msg: pb.ProcessingRequest) -> Iterable[pb.ProcessingResponse]:
        headers = msg.response_headers
        self.done = self.done or headers.end_of_stream  # nothing follows: end the stream (see `Process`)
        routed = self.routed
        if routed is None:
            return (pb.ProcessingResponse(response_headers=pb.HeadersResponse()),)
        try:
            h = header_map(headers)
            # A compressed body (content-encoding) is not read: no usage; its first byte is its first token.
            if h.get("content-encoding", "identity").strip().lower() in ("", "identity"):
                self.usage = UsageReader("text/event-stream" in h.get("content-type", ""))
            try:
                status = int(h.get(":status", "200"))
            except ValueError:
                status = 0
            try:  # (figures go to the endpoint Envoy served; a failure here must not lose the status)
                self.director.on_served(routed, served_endpoint(msg))
            except Exception:
                self.director.bookkeeping_failed("served endpoint")
            self.director.on_response_status(routed, status)
            if headers.end_of_stream:
                self.director.on_first_byte(routed)
        except Exception:
            self.director.bookkeeping_failed("response headers")
        if headers.end_of_stream:
            self._finish(self._end_cause())
        if self.director.decision_header:
            try:
                value = header_value(routed.decision)
            except Exception:
                self.director.bookkeeping_failed("the decision header")
            else:
                explain = pb.CommonResponse(
                    header_mutation=pb.HeaderMutation(set_headers=[header(DECISION_HEADER, value)])
                )
                return (pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=explain)),)
        return (pb.ProcessingResponse(response_headers=pb.HeadersResponse()),)

    def _response_body(self, body: pb.HttpBody) -> Iterable[pb.ProcessingResponse]:
        routed = self.routed
        self.response_bytes += len(body.body)
        if routed is not None:
            usage = self.usage
            try:
                if usage is not None:
                    usage.feed(body.body)
                    if usage.error is not None and routed.stream_error is None:
                        # an error event in a 2xx stream: counted now (before this chunk's first token,
                        # which then calibrates nothing), released as `error` at the end (`_finish`)
                        self.director.on_stream_error(routed, usage.error)
            except Exception:
                self.director.bookkeeping_failed("the response body")
            try:
                # A successful SSE stream's first token is its first event with output
                # (`UsageReader.first_token`), not a keep-alive comment or a Responses API
                # `response.created`; any other response's is its first byte.
                status = routed.status
                tokens = usage is not None and usage.sse and status is not None and 200 <= status < 300
                first = not tokens or (usage is not None and usage.first_token)
                if routed.first_byte_at is None and first:
                    self.director.on_first_byte(routed)
            except Exception:
                self.director.bookkeeping_failed("the response body")
            if body.end_of_stream:
                self._finish(self._end_cause())
        self.done = self.done or body.end_of_stream  # no trailers follow a body's end: end the stream
        if self.response_mode == DUPLEX:
            return (echo(body.body, body.end_of_stream, True),)
        return (pb.ProcessingResponse(response_body=pb.BodyResponse()),)

    def _end_cause(self) -> str:
        """How a response that ended ended: `complete` with a 2xx status, else `error` (`_finish` turns
        `complete` into `error` when the stream carried an error event)."""
        status = self.routed.status if self.routed is not None else None
        return "complete" if status is None or 200 <= status < 300 else "error"

    def _finish(self, cause: str, ended: bool = True) -> None:
        """Release the routed request with its figures; `ended`: its response's end was seen (its body's
        size is then known, when Envoy sent the body)."""
        routed = self.routed
        if routed is None:
            return
        usage, invalid = None, False
        try:
            reader = self.usage
            if reader is not None and cause == "complete":
                usage = reader.finish()  # (reads the last line too, when no newline ended it)
                invalid = reader.invalid
                if reader.error is not None:
                    self.director.on_stream_error(routed, reader.error)
        except Exception:
            self.director.bookkeeping_failed("reading the response's usage")
        if cause == "complete" and routed.stream_error is not None:
            cause = "error"  # a 2xx stream that carried an error event; its usage is still recorded
        try:
            sent = self.response_bytes if ended and self.response_mode != 0 else None  # (NONE: no body sent)
            self.director.finish(routed, cause, usage, invalid, sent)
        except Exception:
            self.director.bookkeeping_failed("releasing the request")
            try:  # the in-flight accounting at least (idempotent)
                self.director.datastore.release(routed.ticket)
            except Exception:
                self.director.bookkeeping_failed("releasing the request's ticket")

    def _close_cause(self) -> str:
        """Why a request whose response's end the EPP did not see is released at the stream's end. When
        the response body mode sends that end (duplex, streamed, buffered) and it did not come:
        `disconnect`. With response_body_mode NONE the stream's end is the response's end: released by
        the status when the response headers came, else `unobserved`: Envoy sent nothing of the response
        (every request under response_header_mode SKIP; under SEND, one whose client left before them).

        How the stream ended cannot tell more: Envoy 1.40 ends every ext_proc stream with a half-close
        followed at once by a reset, when the request completed and when its client reset it alike, and
        grpcio's aio server (1.85) shows a reset as the end of the request messages too (then cancels
        the handler), so a completed request, a client gone and a lost connection look the same here."""
        if self.response_mode != 0:
            return "disconnect"
        return "unobserved" if self.routed is not None and self.routed.status is None else self._end_cause()
