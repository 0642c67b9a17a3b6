"""The modes a run decodes in, defined once: every layer compares a run's mode to these members, never to a
string (a `Mode` is a `StrEnum`, so an option's text, a msgpack message or a JSON row reads back as one)."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    TARGET = "target"  # the target alone, resident
    STD = "std"  # the target alone, streamed under a budget, no prefetch
    STDPL = "stdpl"  # ... with the loader reading ahead
    CHAIN = "chain"  # speculative decoding with a chain of draft tokens
    TREE = "tree"  # token-tree speculation
    FLASH = "flash"  # APPROXIMATE: LLM in a flash's sparse FFN, in this process

    @property
    def speculative(self) -> bool:
        """A draft proposes and the target verifies (chain, tree); the other modes run the target alone."""
        return self in (Mode.CHAIN, Mode.TREE)

    @property
    def streamed(self) -> bool:
        """The target alone streamed under a budget (std, stdpl)."""
        return self in (Mode.STD, Mode.STDPL)

    @property
    def batched(self) -> bool:
        """A batch of generations runs in this mode (engine/sessions.py)."""
        return self in (Mode.TREE, Mode.CHAIN, Mode.TARGET)

    @property
    def shape(self) -> Mode:
        """The speculation's shape its tree settings take (`TreeConfig.mode`): a chain, else a tree."""
        return Mode.CHAIN if self is Mode.CHAIN else Mode.TREE


MODES = tuple(m.value for m in Mode)
