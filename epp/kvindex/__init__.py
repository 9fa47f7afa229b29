"""The exact prefix block index, fed by engine KV events. Pure: no I/O, no clock, no global random.

- `events`: decode engine KV event batches (every vLLM / SGLang shape) into typed events.
- `keys`: our chained block keys from token ids (model / adapter / salt in the root).
- `index`: which pod holds which block on which tier; longest prefix per pod per tier.
- `prompt`: request prompt -> token ids (local Hugging Face tokenizers, chat templates).
"""
