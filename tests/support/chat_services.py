"""Key services over the tiny test tokenizer with chat templates of a test's own, and a request's ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.requests import build_request
from epp.testing.tokenizer import build_tiny_tokenizer


def with_template(base: Path, dst: Path, chat_template: Any) -> Path:
    """A copy of the tokenizer directory `base` whose tokenizer_config.json has `chat_template`."""
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    config = json.loads((base / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": chat_template}))
    return dst


def template_service(factory: pytest.TempPathFactory, templates: dict[str, Any]) -> KvIndexService:
    """A service with model "m" (the tiny tokenizer's own template) and one model per `templates` entry."""
    base = build_tiny_tokenizer(factory.mktemp("tiny"))
    root = factory.mktemp("variants")
    paths = {"m": base, **{name: with_template(base, root / name, t) for name, t in templates.items()}}
    return KvIndexService(BlockIndex(16, 1000), FreshnessTracker(), TokenizerRegistry(paths), 16)


def ids(service: KvIndexService, headers: dict[str, str], body: dict[str, Any]) -> list[int] | None:
    """The prompt ids the service keys a request by (None: unkeyed)."""
    tokens = service.tokenize(build_request(headers, body, {}))
    return None if tokens.ids is None else [int(i) for i in tokens.ids]
