"""The prompt layout lives in the ground (`cag.models.prompt`), because chunks are
prefilled after the layout's head; this name is kept for the top-level callers."""

from cag.models.prompt import INSTRUCTION, PLAIN_TAIL, QUESTION_LINE, PromptLayout, head_ids, layout_for

__all__ = ["INSTRUCTION", "PLAIN_TAIL", "QUESTION_LINE", "PromptLayout", "head_ids", "layout_for"]
