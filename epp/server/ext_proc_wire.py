"""The ext_proc protocol's message shapes: what the EPP reads from Envoy's messages (headers, the
subset hint, the endpoint Envoy served) and the answers it builds (the destination header and `envoy.lb`
metadata, body echoes, immediate error responses). `ext_proc.py` runs the stream with them.

The destination, subset and served keys are the Inference Extension protocol's `x-gateway-destination-*`
names, read and sent under those names only, as llm-d's router does after renaming its own control headers
to `x-llm-d-*` (llm-d/llm-d-router pkg/epp/metadata/consts.go gives them no aliases; the request's control
headers and their aliases are in `epp/requests.py`). A draft of that rename (llm-d/llm-d-router PR #1161 at
commit 29cd704) renamed these keys too, to `x-llm-d-router-destination-endpoint*`; review kept the
protocol's names before it merged (issue #1152), so the draft's names are not read or sent here.
"""

from __future__ import annotations

import functools
import ipaddress
import json
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

from epp.config import parse_endpoint_address

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
REQUEST_ID_HEADER = "x-request-id"
MAX_SHOWN_CHARS = 64
"""A malformed subset entry is quoted in errors and logs up to this many characters."""
MAX_CHUNK = 62_000
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_JSON_CT = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"), append_action=_OVERWRITE
)


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased names; a header sent several times is one comma-joined value (RFC 9110 5.3), so
    a repeated trusted header is visible as such, never silently the last copy."""
    values: dict[str, list[str]] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        values.setdefault(h.key.lower(), []).append(value)
    return {key: ",".join(v) for key, v in values.items()}  # joined once: linear in the copies


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The endpoint Envoy reports it sent the request to, when it says (response path)."""
    md = req.metadata_context.filter_metadata
    if LB_NAMESPACE not in md:
        return None
    value = md[LB_NAMESPACE].fields.get(SERVED_KEY)
    return value.string_value or None if value is not None else None


@dataclass(frozen=True, slots=True)
class SubsetHint:
    """The gateway's subset hint. `allowed` holds normalised entries as endpoint ids are written: `ip:port`
    (that endpoint; IPv6 as `[addr]:port`) or a bare IP (`10.0.0.1`, `[fd00::1]`: every endpoint on that IP,
    which the reference accepts too). `malformed` holds the entries that are neither, as sent (shortened):
    they allow nothing."""

    allowed: frozenset[str]
    malformed: tuple[str, ...] = ()


def subset_entry(entry: str) -> str | None:
    """One subset entry, normalised (see `SubsetHint`), or None when it is neither `ip:port` nor an IP. A
    bare IPv6 address is read whole before any `:port` (`fd00::80` is an address, not `fd00:` port 80).
    Memoised for entries of an address's length: a gateway sends the same pods' entries with every request
    (parsing one costs ~9 us)."""
    return _known_entry(entry) if len(entry) <= _MEMO_CHARS else _parse_entry(entry)


_MEMO_CHARS = 64  # "[ffff:...:ffff]:65535" is 47


@functools.lru_cache(maxsize=8192)
def _known_entry(entry: str) -> str | None:
    return _parse_entry(entry)


def _parse_entry(entry: str) -> str | None:
    entry = entry.strip()
    bracketed = entry.startswith("[") and entry.endswith("]")
    try:
        ip = ipaddress.ip_address(entry[1:-1] if bracketed else entry)
    except ValueError:
        pass
    else:
        return f"[{ip}]" if ip.version == 6 else str(ip)
    try:
        return parse_endpoint_address(entry)
    except ValueError:
        return None


def _shown(text: str) -> str:
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def subset_hint(req: pb.ProcessingRequest) -> SubsetHint | None:
    """The gateway's allowed endpoints, or None when there is no hint. The value is a list of strings (the
    protocol's shape) or one comma-separated string (what a header copied into metadata gives); any other
    value, or a list item that is not a string, is malformed: it allows nothing (the reference ignores such
    items; a whole value of another kind it takes for no hint at all, serving from every endpoint, where
    here it answers 503: the gateway asked for a subset)."""
    md = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in md:
        return None
    fields = md[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    items: list[str] = []
    malformed: list[str] = []
    if kind == "list_value":
        for v in value.list_value.values:
            if v.WhichOneof("kind") == "string_value":
                items.append(v.string_value)
            else:
                malformed.append(json_format.MessageToJson(v, indent=None))
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        malformed.append(json_format.MessageToJson(value, indent=None))
    allowed: set[str] = set()
    for item in items:
        if not item.strip():
            continue  # an empty item names nothing (as an empty list does)
        entry = subset_entry(item)
        if entry is None:
            malformed.append(item.strip())
        else:
            allowed.add(entry)
    return SubsetHint(frozenset(allowed), tuple(_shown(m) for m in malformed))


def header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def error_response(
    status: int, code: str, message: str, retry_after: int | None = None
) -> pb.ProcessingResponse:
    body = json.dumps(
        {"error": {"message": f"inference error: {code} - {message}", "type": code, "code": status}}
    ).encode()
    headers = [_JSON_CT]
    if retry_after is not None:
        headers.append(header("retry-after", str(retry_after)))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=body,
            details=f"epp_{code}",
        )
    )


def destination_mutation(
    value: str, content_length: int | None = None, request_id: str | None = None
) -> pb.CommonResponse:
    """The routing answer's headers. `request_id`: the id the EPP generated for a request that came without
    one, set as `x-request-id` so the model server sees the id the EPP logs and plugins use (as the reference
    does: llm-d/llm-d-router pkg/epp/handlers/server.go generates it into the request's headers, and
    pkg/epp/handlers/request.go `generateHeaders` sets those in the header mutation)."""
    headers = [header(DESTINATION_HEADER, value)]
    if content_length is not None:
        headers.append(header("content-length", str(content_length)))
    if request_id is not None:
        headers.append(header(REQUEST_ID_HEADER, request_id))
    return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True)


def lb_metadata(value: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = value
    return md


def echo(chunk: bytes, eos: bool, response: bool) -> pb.ProcessingResponse:
    body = pb.BodyResponse(
        response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=eos)
            )
        )
    )
    return pb.ProcessingResponse(response_body=body) if response else pb.ProcessingResponse(request_body=body)
