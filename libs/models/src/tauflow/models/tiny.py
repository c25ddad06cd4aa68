"""Small multimodal models built from a config (no download): a character tokenizer with the family's media
tokens, the processor components and the model, saved with ``save_pretrained`` into one folder that loads as
a real checkpoint does (``from_pretrained``). ``build``: a Qwen2.5-Omni thinker (image, audio, video), the
embedded omni example's model and the tests'; ``build_qwen2_vl``: a Qwen2-VL (image, video), the tests'
(docs/omni.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
MEDIA_TOKENS = ["<|IMAGE|>", "<|AUDIO|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>",
                "<|audio_eos|>"]  # fmt: skip
QWEN2_VL_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
IMAGE_SIDE = 56  # pixels: a 4 x 4 grid of 14-pixel patches, 2 x 2 merged: 4 image tokens
SAMPLE_RATE = 16000
AUDIO_SECONDS = 1  # the feature extractor's window: 100 frames -> 25 audio tokens


def vocabulary(chars: str, media_tokens: list[str] = MEDIA_TOKENS) -> dict[str, int]:
    return {t: i for i, t in enumerate([PAD, BOS, EOS, *media_tokens, *chars])}


def _save_tokenizer(out: Path, vocab: dict[str, int], media_tokens: list[str], named: dict[str, str]) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    # media tokens whole, everything else a character
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|[A-Za-z_]+\|>|<s>|</s>|<pad>|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD,
        additional_special_tokens=media_tokens, extra_special_tokens=named,
    )  # fmt: skip
    tokenizer.save_pretrained(out)


def _image_processor() -> Any:
    from transformers import Qwen2VLImageProcessorPil

    side = IMAGE_SIDE * IMAGE_SIDE
    return Qwen2VLImageProcessorPil(min_pixels=side, max_pixels=side, patch_size=14, merge_size=2,
                                    temporal_patch_size=2)  # fmt: skip


def _text_config(vocab: dict[str, int], hidden: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "vocab_size": len(vocab), "hidden_size": hidden, "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "max_position_embeddings": 512, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "pad_token_id": vocab[PAD], "bos_token_id": vocab[BOS], "eos_token_id": vocab[EOS],
    }  # fmt: skip


def build_qwen2_vl(out: str | Path, chars: str = "0123456789+=? ", hidden: int = 64, layers: int = 2,
                   heads: int = 4, seed: int = 0) -> int:  # fmt: skip
    """A Qwen2-VL folder (image and video, no audio); returns the parameter count."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out = Path(out)
    vocab = vocabulary(chars, QWEN2_VL_TOKENS)
    named = dict(zip(["image_token", "video_token", "vision_start_token", "vision_end_token"], QWEN2_VL_TOKENS,
                     strict=True))  # fmt: skip
    _save_tokenizer(out, vocab, QWEN2_VL_TOKENS, named)
    _image_processor().save_pretrained(out)
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config=_text_config(vocab, hidden, layers, heads),
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": hidden,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = vocab[PAD]
    model.generation_config.eos_token_id = vocab[EOS]
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def build(out: str | Path, chars: str = "0123456789+=? ", hidden: int = 64, layers: int = 2, heads: int = 4,
          vision_hidden: int = 32, audio_hidden: int = 32, seed: int = 0) -> int:  # fmt: skip
    """Writes the model folder; returns the parameter count."""
    import torch
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni import (
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

    out = Path(out)
    vocab = vocabulary(chars)
    named = dict(zip(["image_token", "audio_token", "video_token", "vision_bos_token", "vision_eos_token",
                      "audio_bos_token", "audio_eos_token"], MEDIA_TOKENS, strict=True))  # fmt: skip
    _save_tokenizer(out, vocab, MEDIA_TOKENS, named)
    images = _image_processor()
    sounds = WhisperFeatureExtractor(feature_size=32, sampling_rate=SAMPLE_RATE, hop_length=160,
                                     chunk_length=AUDIO_SECONDS, n_fft=400)  # fmt: skip
    # one preprocessor_config.json for both, as Qwen's checkpoints ship it: each Auto class reads its own keys
    merged = {**sounds.to_dict(), **images.to_dict()}
    merged.pop("mel_filters", None)  # recomputed from the sizes at load
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, default=_plain) + "\n")
    torch.manual_seed(seed)
    config = Qwen2_5OmniThinkerConfig(
        audio_config={
            "num_mel_bins": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 2 * audio_hidden,
            "d_model": audio_hidden, "max_source_positions": 100, "n_window": 50, "output_dim": hidden,
        },
        vision_config={
            "depth": 1, "hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden, "num_heads": 2,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 28,
            "out_hidden_size": hidden, "fullatt_block_indexes": [0],
        },
        text_config=_text_config(vocab, hidden, layers, heads),
        audio_token_index=vocab["<|AUDIO|>"], image_token_index=vocab["<|IMAGE|>"],
        video_token_index=vocab["<|VIDEO|>"], audio_start_token_id=vocab["<|audio_bos|>"],
        audio_end_token_id=vocab["<|audio_eos|>"], user_token_id=vocab[BOS], tie_word_embeddings=True,
    )  # fmt: skip
    # (the rope index reads these; Qwen's checkpoints carry them though the config class does not declare them)
    config.vision_start_token_id, config.vision_end_token_id = vocab["<|vision_bos|>"], vocab["<|vision_eos|>"]
    model = Qwen2_5OmniThinkerForConditionalGeneration(config)
    model.generation_config.pad_token_id = vocab[PAD]
    model.generation_config.eos_token_id = vocab[EOS]
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


# -- a tiny instruct model: byte-level BPE trained here, a ChatML chat template --------------------------------

CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the turn format of Qwen's instruct models: each turn "<|im_start|>{role}\n{content}<|im_end|>\n"; the
# generation prompt opens the assistant's turn, and the model ends its turn with <|im_end|> (its EOS).
CHATML_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_chat_tokenizer(out: str | Path, corpus: list[str], vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` by the ``tokenizers`` library, with ChatML's special
    tokens and chat template, saved with ``save_pretrained`` (what a real instruct checkpoint ships)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=CHAT_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def build_chat_model(
    out: str | Path,
    corpus: list[str],
    vocab_size: int = 512,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 1024,
    seed: int = 0,
) -> Path:
    """A tiny Qwen2 instruct model in ``out``: ``build_chat_tokenizer`` and a randomly initialised model of its
    vocabulary, whose EOS is <|im_end|> (``from_pretrained`` loads both)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    out = Path(out)
    tokenizer = build_chat_tokenizer(out, corpus, vocab_size)
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=pad,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    return out


def sft_chat(
    model_dir: str | Path, pairs: Sequence[tuple[list[dict[str, str]], str]], steps: int, lr: float, seed: int = 0
) -> float:
    """Fine-tunes the chat model in ``model_dir`` on (chat, reply) pairs — the loss on the reply and its
    <|im_end|> only — and saves it back; returns the last batch's loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = []
    for chat, reply in pairs:
        prompt = tok.encode(
            tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        answer = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    pad = tok.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r, _ in rows])[:, None]).long()
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = torch.randint(0, len(rows), (min(32, len(rows)),))
        loss = model(input_ids=ids[batch], attention_mask=mask[batch], labels=labels[batch]).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.save_pretrained(model_dir)
    return float(loss.detach())
