"""The ``megatron`` trainer backend's parts: Hugging Face ↔ megatron-core weight conversion (``convert``, plain
tensor code) and the GPTModel built from a Hugging Face config (``model``, imports megatron-core lazily: the
``megatron`` extra)."""
