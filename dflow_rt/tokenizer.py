"""Byte-level BPE tokenizers with the special tokens the drafter and chat mode need."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dflow_rt.errors import CheckpointError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE over `texts` (every byte is a token, so no input is ever unknown)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", mask_token="<|MASK|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHAT_TEMPLATE,
    )


def load_tokenizer(directory: str | Path):
    """The HF fast tokenizer of a model directory (its `tokenizer.json`)."""
    from transformers import AutoTokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(path, "missing: the target directory needs a tokenizer to take text prompts")
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as err:  # tokenizers raises plain Exceptions for malformed files
        raise CheckpointError(path, f"unreadable tokenizer ({err})") from None


def stop_token_ids(tokenizer) -> list[int]:
    """End-of-text and end-of-turn ids that the tokenizer knows."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return sorted(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id)
