"""The model folder's tokenizer, as the rollout service uses it: text and chats to token ids, ids to text."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class ChatTemplateError(ValueError):
    """The model's chat template cannot format a chat: it has none, or it refused this one (a system turn
    Gemma's does not take, roles Llama-2's wants alternating)."""


class NoChatTemplate(ChatTemplateError):
    """A chat prompt for a tokenizer that has no chat template."""


class TextCodec:
    """Encodes prompts and decodes completions with the tokenizer saved in the model's folder
    (``AutoTokenizer.from_pretrained``, as a real checkpoint ships it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._specials = tuple(
            {*getattr(tokenizer, "all_special_tokens", ()), *(t.content for t in added.values() if t.special)}
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

    def encode(self, text: str) -> list[int]:
        """Text as it is (no chat template), with the special tokens the tokenizer adds to any text."""
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A chat through the model's chat template, the assistant's turn opened (``add_generation_prompt``).
        The template is rendered to text and the text tokenized without special tokens added: the template
        already wrote them (and ``apply_chat_template(tokenize=True)`` returns a different type per
        transformers release)."""
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
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence decodes to one string (decode also takes a batch)
        return text
