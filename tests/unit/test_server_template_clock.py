"""The server gives chat templates a wall clock: `strftime_now` renders today's date, as transformers does
in the engine (Llama 3.x templates write "Today Date" into the system prompt, so a wrong date changes
every key after it)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from datetime import datetime

from epp.config import StaticEndpoint, default_config
from epp.server.app import EppServer, ServerSettings
from epp.testing.tokenizer import build_tiny_tokenizer

TEMPLATE = (
    "{{ bos_token }}Today Date: {{ strftime_now('%d %b %Y') }}\n"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def test_strftime_now_renders_the_date_of_today_in_the_server(tmp_path: pathlib.Path) -> None:
    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    config_file = tok_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATE  # (unguarded: without a clock, rendering fails)
    config_file.write_text(json.dumps(config))
    cfg = dataclasses.replace(default_config(), tokenizers={"m": str(tok_dir)})
    settings = ServerSettings(host="127.0.0.1", grpc_port=0, grpc_health_port=0, metrics_port=0)
    server = EppServer(settings, cfg, [StaticEndpoint("127.0.0.1:1", None)])
    tok = server.kv.tokenizers.get("m")
    assert tok is not None
    before = datetime.now().strftime("%d %b %Y")
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    after = datetime.now().strftime("%d %b %Y")
    assert text.split("\n")[0].removeprefix(tok.special_tokens["bos_token"]) in {
        f"Today Date: {before}",
        f"Today Date: {after}",  # (midnight passed while it ran)
    }
