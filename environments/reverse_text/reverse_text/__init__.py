"""reverse-text: a verifiers v1 taskset with generated data (no dataset download)."""

from reverse_text.taskset import ReverseTextTaskset

__all__ = ["ReverseTextTaskset"]
