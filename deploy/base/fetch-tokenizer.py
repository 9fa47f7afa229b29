"""Fetch a model's tokenizer files from the Hugging Face Hub into a directory.

Runs as the EPP pod's init container (standard library only), so the EPP finds the local
tokenizer its config names. Environment:
  MODEL        repository id, e.g. meta-llama/Llama-3.1-8B-Instruct (required)
  DEST         directory to write into (required)
  REVISION     branch, tag or commit (default: main)
  HF_ENDPOINT  the Hub or a mirror (default: https://huggingface.co)
  HF_TOKEN     access token for gated models (optional)
The Hub answers large files with a redirect to its CDN: redirects are followed (at most
MAX_REDIRECTS), and the token goes only to the scheme, host and port it was meant for, never to a
redirect target elsewhere.
tokenizer.json is required; tokenizer_config.json, special_tokens_map.json, the chat template files, the
model's config.json and its processor's config files (what the EPP reads to build the tokenizer as vLLM's
transformers 5 does) are fetched when the repository has them. Nothing is written unless every required
file was fetched. Not fetched: additional_chat_templates/ (listing a directory needs the Hub's API).
Exit status: 0 done, 1 a download failed, 2 bad environment.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REQUIRED = ("tokenizer.json",)
OPTIONAL = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",  # the model type, which picks the tokenizer class transformers 5 builds
    "processor_config.json",  # a processor: its chat_template.json is vLLM's for chats without tools
    "preprocessor_config.json",
)
TIMEOUT_SECONDS = 60.0
MAX_REDIRECTS = 5
DEFAULT_PORTS = {"http": 80, "https": 443}


class FetchError(Exception):
    pass


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the port made explicit and the host lower-cased."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # not a number: never equal to a real origin
        port = -1
    return scheme, (parts.hostname or ""), DEFAULT_PORTS.get(scheme) if port is None else port


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows at most MAX_REDIRECTS redirects; drops Authorization when one leaves the origin.

    urllib copies every header of the request (Authorization included) to the redirected one,
    wherever it points; the Hub redirects large files to a CDN, which must not see the token.
    """

    # urllib's own limits, one above ours, so that ours (with its message) is what stops a loop.
    max_redirections = max_repeats = MAX_REDIRECTS + 1

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        hops = getattr(req, "epp_redirects", 0) + 1
        if hops > MAX_REDIRECTS:
            fp.close()
            raise FetchError(f"more than {MAX_REDIRECTS} redirects (the last to {newurl})")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.epp_redirects = hops  # type: ignore[attr-defined]
            if origin(newurl) != origin(req.full_url):
                new.remove_header("Authorization")  # add_header stored it under this spelling
        return new


_OPENER = urllib.request.build_opener(_Redirects)


def _get(url: str, token: str | None) -> bytes | None:
    """The body at `url`, or None when the Hub says the file does not exist (404)."""
    request = urllib.request.Request(url, headers={"User-Agent": "epp-fetch-tokenizer"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with _OPENER.open(request, timeout=TIMEOUT_SECONDS) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        hint = ""
        if err.code in (401, 403):
            hint = " (a gated model needs HF_TOKEN with access to it)" if not token else " (HF_TOKEN refused)"
        raise FetchError(f"{url}: HTTP {err.code}{hint}") from None
    except (urllib.error.URLError, OSError) as err:
        raise FetchError(f"{url}: {getattr(err, 'reason', err)}") from None
    except FetchError as err:
        raise FetchError(f"{url}: {err}") from None


def fetch(environ: Mapping[str, str]) -> dict[str, bytes]:
    """Every file the repository has among REQUIRED + OPTIONAL; FetchError if a required one is missing."""
    model, revision = environ["MODEL"].strip("/"), environ.get("REVISION") or "main"
    endpoint = (environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    token = environ.get("HF_TOKEN") or None
    files: dict[str, bytes] = {}
    for name in (*REQUIRED, *OPTIONAL):
        url = f"{endpoint}/{urllib.parse.quote(model)}/resolve/{urllib.parse.quote(revision)}/{name}"
        body = _get(url, token)
        if body is None:
            if name in REQUIRED:
                raise FetchError(f"{url}: not found (404): is MODEL={model!r} right?")
            continue
        if name.endswith(".json"):
            try:
                json.loads(body)
            except ValueError as err:
                raise FetchError(f"{url}: not valid JSON: {err}") from None
        files[name] = body
    return files


def write(dest: Path, files: Mapping[str, bytes]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        partial = dest / f".{name}.partial"
        partial.write_bytes(body)
        partial.replace(dest / name)


def main(environ: Mapping[str, str]) -> int:
    missing = [k for k in ("MODEL", "DEST") if not environ.get(k)]
    if missing:
        print(f"fetch-tokenizer: set {' and '.join(missing)}", file=sys.stderr)
        return 2
    try:
        files = fetch(environ)
    except FetchError as err:
        print(f"fetch-tokenizer: {err}", file=sys.stderr)
        return 1
    dest = Path(environ["DEST"])
    try:
        write(dest, files)
    except OSError as err:
        print(f"fetch-tokenizer: cannot write {dest}: {err}", file=sys.stderr)
        return 1
    print(f"fetch-tokenizer: {environ['MODEL']}: wrote {', '.join(sorted(files))} to {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(os.environ))
