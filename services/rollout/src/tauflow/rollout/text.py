"""The model folder's tokenizer, as the rollout service uses it: text and chats to token ids, ids to text.

Tokenizing costs time in proportion to the text (0.56 s for 256 Ki CJK characters on a byte-level BPE),
whatever the context then refuses. ``max_chars_per_token`` bounds how many characters of a text one token can
stand for, where the tokenizer's pipeline lets that be proven (``chars_per_token_bound``); a text too long
for the context by that bound is refused before it is tokenized (``PromptTooLong``), without refusing any
text that would have fit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class ChatTemplateError(ValueError):
    """The model's chat template cannot format a chat: it has none, or it refused this one (a system turn
    Gemma's does not take, roles Llama-2's wants alternating)."""


class NoChatTemplate(ChatTemplateError):
    """A chat prompt for a tokenizer that has no chat template."""


class PromptTooLong(ValueError):
    """A text that holds more tokens than allowed, known from its length alone (it was not tokenized)."""


# Normalizers that never make a text shorter (in characters): decompositions, case mapping, a prefix added, bytes
# mapped to characters. (A Replace is checked on its own: it must not replace a string by a shorter one.)
_NON_SHRINKING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
# Compositions: at most 4 characters become one (the longest canonical decomposition has 4, e.g. U+1F82; a
# Hangul syllable has 3).
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
COMPOSITION_FACTOR = 4
# Pre-tokenizers that split a text without dropping a character (Split and Punctuation unless their behaviour
# is "Removed"); Whitespace, WhitespaceSplit, BertPreTokenizer and CharDelimiterSplit drop some.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})


def chars_per_token_bound(pipeline: Mapping[str, Any]) -> int | None:
    """The most characters of a text that one token of this tokenizer (its ``tokenizer.json``, as the fast
    tokenizer serializes it) can stand for, or None where no bound can be proven.

    A text of n characters then takes at least ceil(n / bound) tokens. It holds for a BPE model (each token
    covers a run of at most L characters of what the model is given, L its longest vocabulary entry, or an
    added token's content) whose every character reaches a token (the byte-level alphabet, byte fallback, or an
    unknown token per unknown character; never a run of unknowns fused into one token), behind normalizers
    that do not shorten the text or shorten it at most COMPOSITION_FACTOR-fold (NFC, NFKC), and pre-tokenizers
    that drop nothing. A byte-level token covers at least one byte, so at most as many characters as bytes. Not
    provable, hence None: WordPiece (a word too long for it is one [UNK]), Unigram, a fused unknown, a
    normalizer that strips or collapses (Strip, StripAccents, BertNormalizer, Precompiled, a Replace with a
    regex or a shorter string), a pre-tokenizer that drops whitespace, an added token that swallows the
    whitespace beside it (lstrip, rstrip)."""
    model = pipeline.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, Mapping) or not vocab:
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    factor = _shrink_factor(pipeline.get("normalizer"))
    if factor is None or not _keeps_every_character(pipeline.get("pre_tokenizer")):
        return None
    added = pipeline.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    kinds = _kinds(pipeline.get("pre_tokenizer")) | _kinds(pipeline.get("normalizer"))
    if "ByteLevel" in kinds:
        from tokenizers.pre_tokenizers import ByteLevel

        reaches = all(c in vocab for c in ByteLevel.alphabet())
    elif model.get("byte_fallback"):
        reaches = all(f"<0x{b:02X}>" in vocab for b in range(256))
    else:
        reaches = False
    if not reaches:  # an unknown character: one unknown token each, unless they are fused
        reaches = model.get("unk_token") in vocab and not model.get("fuse_unk")
    if not reaches:
        return None  # (a character that reaches no token is dropped)
    longest = max(max(map(len, vocab)), max((len(a.get("content", "")) for a in added), default=1))
    return max(1, longest) * factor


def _kinds(component: Any) -> set[str]:
    if not isinstance(component, Mapping):
        return set()
    inner = component.get("normalizers") or component.get("pretokenizers") or []
    return {str(component.get("type"))}.union(*(_kinds(c) for c in inner))


def _shrink_factor(normalizer: Any) -> int | None:
    """How many times shorter the normalizer can make a text at most; None: unbounded (or unknown)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers") or []:
            f = _shrink_factor(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _NON_SHRINKING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return COMPOSITION_FACTOR
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        if "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"]):
            return 1
    return None


def _keeps_every_character(pre_tokenizer: Any) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(p) for p in pre_tokenizer.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


class TextCodec:
    """Encodes prompts and decodes completions with the tokenizer saved in the model's folder
    (``AutoTokenizer.from_pretrained``, as a real checkpoint ships it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._specials = tuple(
            {*getattr(tokenizer, "all_special_tokens", ()), *(t.content for t in added.values() if t.special)}
        )
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's pipeline (None: a slow one)
        try:
            pipeline = json.loads(backend.to_str()) if backend is not None else {}
        except (AttributeError, TypeError, ValueError):
            pipeline = {}
        # at most this many characters of a text per token (None: no bound proven, every text is tokenized)
        self.max_chars_per_token = chars_per_token_bound(pipeline) if isinstance(pipeline, dict) else None

    def min_tokens(self, text: str) -> int:
        """A number of tokens ``text`` is known to take at least, from its length alone (0 when unknown)."""
        if self.max_chars_per_token is None:
            return 0
        return math.ceil(len(text) / self.max_chars_per_token)

    def check_length(self, text: str, max_tokens: int | None, what: str = "prompt_text") -> None:
        """Raise PromptTooLong when ``text`` holds more than ``max_tokens`` tokens by its length alone (before
        it is tokenized); None: no limit."""
        if max_tokens is None:
            return
        least = self.min_tokens(text)
        if least > max_tokens:
            raise PromptTooLong(
                f"{what}: {len(text)} characters are at least {least} tokens for this model's tokenizer (at most "
                f"{self.max_chars_per_token} characters a token), over the {max(0, max_tokens)} allowed"
            )

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's end-of-sequence token (an instruct model's end of turn)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos if isinstance(eos, int) else None

    @classmethod
    def from_folder(cls, model_path: str | Path) -> TextCodec | None:
        """The folder's tokenizer; ``None`` for a folder without one (a model that takes token ids only)."""
        if not (Path(model_path) / "tokenizer_config.json").exists():
            return None
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Text as it is (no chat template), with the special tokens the tokenizer adds to any text.
        PromptTooLong, without tokenizing, for a text that is surely over ``max_tokens``."""
        self.check_length(text, max_tokens)
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: Sequence[dict[str, str]], max_tokens: int | None = None) -> list[int]:
        """A chat through the model's chat template, the assistant's turn opened (``add_generation_prompt``).
        The template is rendered to text and the text tokenized without special tokens added: the template
        already wrote them (and ``apply_chat_template(tokenize=True)`` returns a different type per
        transformers release). PromptTooLong, without tokenizing, for a rendered chat surely over
        ``max_tokens``."""
        if not self.has_chat_template:
            raise NoChatTemplate("the model's tokenizer has no chat template (tokenizer_config.json chat_template)")
        for i, m in enumerate(messages):
            # The rendered text is tokenized as a whole: a special token spelled in a message would become that
            # token, and end its turn or open another (a policy forging turns in a judge's chat)
            spelled = next((t for t in self._specials if t in m["content"]), None)
            if spelled is not None:
                raise ChatTemplateError(f"message {i} spells the special token {spelled[:40]!r}")
        try:
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError (raise_exception in a template), and kin
            raise ChatTemplateError(
                f"the model's chat template refused it: {type(e).__name__}: {str(e)[:200]}"
            ) from None
        self.check_length(text, max_tokens, "prompt_messages")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence decodes to one string (decode also takes a batch)
        return text
