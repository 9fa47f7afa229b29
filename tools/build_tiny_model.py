"""Build a tiny random-weight Llama model directory that a real vLLM can serve on the CPU.

    .venv-vllm/bin/python tools/build_tiny_model.py build/tiny-model

Deterministic for a given `--seed`: a byte-level BPE tokenizer trained on generated text
(tokenizer.json + tokenizer_config.json with a chat template) and a `LlamaForCausalLM` with 2
layers, hidden size 128 and 2 heads whose vocabulary matches the tokenizer, saved with
`save_pretrained`. The weights are random, so the model's output is gibberish; token counts,
prefix caching and KV events are real. The directory doubles as a local tokenizer for the EPP
and for load generators.

Runs in the vLLM venv (it needs torch and transformers); the EPP itself is not installed
there, so the shared tokenizer builder `epp/testing/tokenizer.py` is loaded by file path
when present, and a built-in equivalent is used otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHARED_BUILDER = ROOT / "epp" / "testing" / "tokenizer.py"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (
    "the", "cache", "prefix", "block", "token", "engine", "request", "model", "server", "router",
    "gateway", "envoy", "index", "event", "prompt", "reply", "user", "system", "assistant", "question",
    "answer", "time", "queue", "memory", "layer", "head", "batch", "stream", "score", "pick",
    "endpoint", "pod", "fresh", "stale", "replay", "publisher", "subscriber", "decode", "encode",
    "hash", "chain", "store", "remove", "clear", "tier", "device", "host", "storage", "adapter",
    "salt", "tenant", "weight", "random", "seed", "config", "value",
)  # fmt: skip


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if i % 3 == 0:
            words.append(str(rng.randint(0, 99999)))
        if i % 5 == 0:
            words.insert(
                0, "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
            )
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!,;:"))
    return out


def build_tokenizer_builtin(directory: Path, vocab_size: int = 512, seed: int = 0) -> Path:
    """A byte-level BPE trained on generated text; no BOS is added by the tokenizer itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def build_tokenizer(directory: Path, vocab_size: int, seed: int) -> tuple[Path, str]:
    """The shared builder when it is there (loaded by path: the EPP is not installed in this venv)."""
    if SHARED_BUILDER.is_file():
        try:
            spec = importlib.util.spec_from_file_location("_epp_tiny_tokenizer", SHARED_BUILDER)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            path = module.build_tiny_tokenizer(directory, vocab_size=vocab_size, seed=seed)
            return Path(path), str(SHARED_BUILDER.relative_to(ROOT))
        except Exception as err:  # an unfinished or incompatible shared builder: fall back
            print(
                f"note: {SHARED_BUILDER} unusable here ({err!r}); using the built-in builder", file=sys.stderr
            )
    return build_tokenizer_builtin(directory, vocab_size, seed), "built-in"


def _special_id(tok: Any, config: dict[str, Any], name: str) -> int | None:
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        return None
    tid = tok.token_to_id(value)
    return int(tid) if tid is not None else None


def build_model(directory: Path, seed: int = 0) -> int:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok_config = json.loads((directory / "tokenizer_config.json").read_text())
    vocab = tok.get_vocab_size(with_added_tokens=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=_special_id(tok, tok_config, "bos_token"),
        eos_token_id=_special_id(tok, tok_config, "eos_token"),
        pad_token_id=_special_id(tok, tok_config, "pad_token"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return vocab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    directory: Path = args.directory
    directory.mkdir(parents=True, exist_ok=True)
    _, source = build_tokenizer(directory, args.vocab_size, args.seed)
    vocab = build_model(directory, args.seed)
    print(f"built {directory}: tokenizer ({source}), vocab {vocab}, LlamaForCausalLM 2x128, seed {args.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
