"""lowercase: a verifiers v1 taskset with generated prompts (no dataset download)."""

from lowercase.taskset import LowercaseTaskset

__all__ = ["LowercaseTaskset"]
