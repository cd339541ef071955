"""Command-line converters between HuggingFace directories and Megatron dist checkpoints."""
