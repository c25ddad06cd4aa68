"""The addition task: a character vocabulary, the tiny Qwen2 model, the data sets and the reward.

`BOS a a + b b =` -> the digits of a + b, then EOS; reward 1 for an exact answer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHARS = list("0123456789+=")
VOCAB = {PAD: 0, BOS: 1, EOS: 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
MAX_NEW_TOKENS = 4  # up to three digits of the sum, then EOS


def build_tokenizer(out: Path) -> None:
    """A character-level Hugging Face tokenizer saved with save_pretrained."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, VOCAB[BOS])])
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD)
    fast.save_pretrained(out)


def build_model(out: Path, hidden: int = 128, layers: int = 2, heads: int = 8, seed: int = 0) -> int:
    """A tiny Qwen2 model from a config, saved with save_pretrained; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        bos_token_id=VOCAB[BOS],
        eos_token_id=VOCAB[EOS],
        pad_token_id=VOCAB[PAD],
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def problems(seed: int = 0, heldout: int = 500) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All two-digit pairs, split into train and a fixed held-out set."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs[heldout:], pairs[:heldout]


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def prompt_ids(a: int, b: int) -> list[int]:
    return [VOCAB[BOS]] + [VOCAB[c] for c in prompt_text(a, b)]


def answer_ids(a: int, b: int) -> list[int]:
    return [VOCAB[c] for c in str(a + b)] + [VOCAB[EOS]]


def write_jsonl(path: Path, pairs: list[tuple[int, int]]) -> None:
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"id": f"{a}+{b}", "prompt": prompt_text(a, b), "answer": str(a + b)}) + "\n" for a, b in pairs
        )
