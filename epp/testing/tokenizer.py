"""Tiny, local tokenizer directories for tests, benchmarks and the demo (Llama-3-shaped; Llama-2-shaped).

`build_tiny_tokenizer(dir)` trains a byte-level BPE with `tokenizers` on deterministic generated
text (no download), and writes what a Hugging Face model directory holds for its tokenizer:

- `tokenizer.json`: Llama-3 pre-tokenizer regex + byte-level, Llama-3 special tokens, a
  `TemplateProcessing` post-processor that adds `<|begin_of_text|>` (as Llama 3's does);
- `tokenizer_config.json`: `bos_token`, `eos_token`, and a Llama-3-like Jinja `chat_template`
  (bos token, system/user/assistant/tool roles, `raise_exception`, tools as `tojson`, list content
  parts, `add_generation_prompt`).

The same arguments give byte-identical files. `transformers.AutoTokenizer` and vLLM load the
directory as it is.

`build_tiny_spm_tokenizer(dir)` does the same for a sentencepiece-shaped (Llama 2, Mistral) one, whose
`LlamaTokenizer` class transformers 5 rebuilds in code (`kvindex/tokenizer_files.py`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SPECIAL_TOKENS = (BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# The Llama 3 / cl100k pre-tokenizer pattern.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = """{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if system_message is not none or tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
    {%- if tools %}
        {{- 'You can call these functions. Answer with JSON {"name": ..., "arguments": ...}.\\n' }}
        {%- for tool in tools %}
            {{- tool | tojson(indent=2) }}
            {{- '\\n' }}
        {%- endfor %}
    {%- endif %}
    {%- if system_message is string %}
        {{- system_message | trim }}
    {%- elif system_message is not none %}
        {%- for part in system_message %}
            {%- if part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] not in ('user', 'assistant', 'tool') %}
        {{- raise_exception('Conversation roles must be user, assistant or tool after an optional system '
                            'message; got ' ~ message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['content'] is string %}
        {{- message['content'].strip() }}
    {%- elif message['content'] is not none %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}
        {%- endfor %}
    {%- endif %}
    {%- if message.tool_calls is defined and message.tool_calls %}
        {%- for call in message.tool_calls %}
            {%- set function = call['function'] %}
            {{- '\\n' + {'name': function['name'], 'arguments': function['arguments']} | tojson }}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

_SYLLABLES = (
    "ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "an", "en", "in", "on", "th", "er", "re", "st",
    "de", "ch", "qu", "ze", "vo", "ly", "ing", "tion", "ment", "ous", "ble", "pre", "con", "ex",
)  # fmt: skip
_WORDS = ("the", "of", "and", "to", "a", "in", "is", "you", "that", "it", "for", "as", "with", "on")
_PUNCT = (".", ",", ";", ":", "!", "?", "...", " -", "'s", "'t", "(", ")", '"', "/", "#", "==")
_EXOTIC = ("é", "ü", "ñ", "ß", "中文", "日本語", "Ω", "→", "😀", "🚀", "👍🏽", "\t", "  ", "    ")


def _corpus(seed: int, sentences: int = 3000) -> list[str]:
    """Deterministic pseudo-text: words, numbers, punctuation, code-ish lines, a little unicode."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(sentences):
        words: list[str] = []
        for _ in range(rng.randint(3, 14)):
            r = rng.random()
            if r < 0.45:
                words.append(rng.choice(_WORDS))
            elif r < 0.85:
                word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
                words.append(word.capitalize() if rng.random() < 0.15 else word)
            elif r < 0.93:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
            else:
                words.append(rng.choice(_EXOTIC))
            if rng.random() < 0.12:
                words[-1] += rng.choice(_PUNCT)
        line = " ".join(words)
        if rng.random() < 0.1:
            line = "    " + line.replace(" ", "_") + "()"
        lines.append(line + rng.choice((".", ".", "?", "!", ":", "")))
    return lines


def generated_text(chars: int, seed: int = 1) -> str:
    """About `chars` characters of deterministic pseudo-text (the training distribution, another seed)."""
    out: list[str] = []
    size, n = 0, 0
    while size < chars:
        for line in _corpus(seed * 1_000_003 + n, 200):
            out.append(line)
            size += len(line) + 1
            if size >= chars:
                break
        n += 1
    return " ".join(out)[:chars]


def build_tiny_tokenizer(directory: str | Path, vocab_size: int = 512, seed: int = 0) -> Path:
    """Train and save a tiny byte-level BPE tokenizer with a Llama-3-like chat template; return the dir."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    tok.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


SPM_BOS, SPM_EOS, SPM_UNK = "<s>", "</s>", "<unk>"
SPM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def build_tiny_spm_tokenizer(directory: str | Path, vocab_size: int = 700, seed: int = 0) -> Path:
    """Train and save a tiny sentencepiece-shaped BPE tokenizer, as Llama 2 and Mistral ship theirs: `▁` for
    spaces (a `Prepend` + `Replace` normalizer, no pre-tokenizer), byte fallback (`<0x00>`...), a
    post-processor adding `<s>`, and a `LlamaTokenizer` tokenizer_config.json (`add_bos_token`, a Llama-2-like
    `[INST]` chat template). The same arguments give byte-identical files."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=SPM_UNK, byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[SPM_UNK, SPM_BOS, SPM_EOS, *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bos_id = tok.token_to_id(SPM_BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPM_BOS}:0 $A:0",
        pair=f"{SPM_BOS}:0 $A:0 {SPM_BOS}:1 $B:1",
        special_tokens=[(SPM_BOS, bos_id)],
    )
    tok.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": SPM_BOS,
        "chat_template": SPM_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPM_EOS,
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": SPM_UNK,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
