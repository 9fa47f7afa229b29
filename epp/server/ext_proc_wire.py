"""The ext_proc protocol's message shapes: what the EPP reads from Envoy's messages (headers, the
subset hint, the endpoint Envoy served) and the answers it builds (the destination header and `envoy.lb`
metadata, body echoes, immediate error responses). `ext_proc.py` runs the stream with them.
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
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


def subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    """The gateway's allowed endpoints, or None when there is no hint."""
    md = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in md:
        return None
    fields = md[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return [i.strip() for i in items if i.strip()]


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


def destination_mutation(value: str, content_length: int | None = None) -> pb.CommonResponse:
    headers = [header(DESTINATION_HEADER, value)]
    if content_length is not None:
        headers.append(header("content-length", str(content_length)))
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
