"""Load the models a mode needs once, then generate prompt after prompt; rows for the JSON contract."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from cadence.errors import CadenceError
from launch.prompts import Prompt, prompt_ids
from launch.results import make_row, peak_rss_bytes
from models import engine
from models.sampling import SamplingConfig
from models.tokenizer import StreamDecoder

MODES = ("target",)


@dataclass(frozen=True)
class RunConfig:
    target: str
    draft: str | None
    fmt: str
    mode: str = "target"
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    chat: str = "auto"
    device: str = "cpu"

    def __post_init__(self):
        if self.mode not in MODES:
            raise CadenceError(f"mode '{self.mode}' is not known; use one of {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise CadenceError(f"--max-new-tokens={self.max_new_tokens} must be at least 1")
        if self.chat not in ("auto", "on", "off"):
            raise CadenceError(f"--chat={self.chat} must be auto, on or off")


class Runner:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.target = engine.load(cfg.target, cfg.fmt, cfg.device)

    def run(self, prompt: Prompt, on_text: Callable[[str], None] | None = None) -> dict:
        cfg, tok = self.cfg, self.target.tokenizer
        ids, chat = prompt_ids(tok, prompt, cfg.chat)
        stream = StreamDecoder(tok)
        on_tokens = (lambda new: on_text(stream.push(new))) if on_text else None
        gen = engine.generate_target(self.target, ids, cfg.max_new_tokens, cfg.sampling, on_tokens)
        return make_row(id=prompt.id, kind=prompt.kind, mode=cfg.mode, target=cfg.target,
                        draft=cfg.draft if cfg.mode != "target" else None, format=cfg.fmt, chat=chat,
                        prompt_token_ids=ids, new_token_ids=gen.new_ids, text=tok.decode(gen.new_ids),
                        wall_s=gen.wall_s, prefill_s=gen.prefill_s, peak_rss_bytes=peak_rss_bytes(), stats=gen.stats)


def print_text(piece: str):
    sys.stdout.write(piece)
    sys.stdout.flush()
