"""vLLM 0.33's prompt-update shapes, for the benchmarks and the tests of the kept updates.

What vLLM's processor passes with an image item: one ``ResolvedPromptUpdate`` (a frozen
dataclass of a str, an int, a ``str`` enum member, a list of token ids and a
``PromptUpdateDetails``, itself a dataclass of the item's 576 placeholder token ids), made new
for every item. Many models make its ``is_embed`` with ``PromptUpdateDetails.select_token_id``:
a new closure per item. As in vLLM's module there is no ``from __future__ import annotations``
here: each ``def`` of that closure evaluates its annotations, a new ``list[int]`` every time.
"""

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: vLLM's placeholder token of an image, and the placeholder tokens of one image
IMAGE_TOKEN = 32000
IMAGE_TOKENS = 576


class UpdateMode(str, enum.Enum):  # noqa: UP042 (vLLM's own shape, not StrEnum)
    """vLLM's ``UpdateMode``: a ``str`` enum."""

    INSERT = "insert"
    REPLACE = "replace"


@dataclass
class Details:
    """vLLM's ``PromptUpdateDetails``: an update's tokens and which of them are embeddings."""

    full: list[int]
    is_embed: Callable[[list[int]], np.ndarray] | None = None

    @staticmethod
    def select_token_id(seq: list[int], embed_token_id: int) -> "Details":
        """vLLM's: the embeddings are the tokens equal to one id (a new closure per call)."""

        def is_embed(full: list[int]) -> np.ndarray:
            out: np.ndarray = np.asarray(full) == embed_token_id
            return out

        return Details(full=seq, is_embed=is_embed)

    @staticmethod
    def select_token_ids(seq: list[int], embed_token_ids: list[int]) -> "Details":
        """vLLM's: the embeddings are the tokens among some ids (a new closure per call)."""

        def is_embed(full: list[int]) -> np.ndarray:
            return np.isin(np.asarray(full), np.asarray(embed_token_ids))

        return Details(full=seq, is_embed=is_embed)


@dataclass(frozen=True)
class Update:
    """vLLM's ``ResolvedPromptUpdate``: a frozen dataclass of a few fields."""

    modality: str
    item_idx: int
    mode: UpdateMode
    target: list[int]
    content: Details


def image_updates(i: int, closure: bool = False) -> list[Update]:
    """The prompt updates vLLM's processor passes with image ``i``: a new list, made new for
    every item; with ``closure``, its ``is_embed`` made by ``select_token_id``."""
    seq = [IMAGE_TOKEN] * IMAGE_TOKENS
    details = Details.select_token_id(seq, IMAGE_TOKEN) if closure else Details(seq)
    return [Update("image", i % 8, UpdateMode.REPLACE, [IMAGE_TOKEN], details)]
