"""What a generation gives back: a `Chunk` per cycle as it streams, a `Completion` at its end, and the
JSON row of it that `launch run --json` and `launch bench --json` write (a public contract).

One row per (prompt, mode). Fields every row has (see README "JSON rows"):
  id, kind, mode, target, draft, format, chat, prompt_token_ids, new_token_ids, text,
  wall_s, prefill_s, tokens_per_s, peak_rss_bytes, stats
"""

from __future__ import annotations

import json
import resource
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import CadenceError

ROW_FIELDS = (
    "id",
    "kind",
    "mode",
    "target",
    "draft",
    "format",
    "chat",
    "prompt_token_ids",
    "new_token_ids",
    "text",
    "wall_s",
    "prefill_s",
    "tokens_per_s",
    "peak_rss_bytes",
    "stats",
)


@dataclass(frozen=True)
class Completion:
    text: str  # the generated text (a stop token is never part of it)
    token_ids: list[int]  # the generated tokens (a stop token, if one was reached, is the last)
    finish_reason: str  # "stop": a stop token ended it; "length": --max-new-tokens or the context did
    prompt_tokens: int
    tokens_per_s: float
    stats: dict = field(default_factory=dict)  # what the mode did: verifications, acceptance, bytes read, ...
    row: dict = field(default_factory=dict)  # the JSON row
    tool_calls: list = field(default_factory=list)  # the calls an answer to a request with tools made (engine/tools.py)


@dataclass(frozen=True)
class Chunk:
    """One speculation cycle of a generation as it streams: the text it committed (the concatenation
    of a generation's chunks is its text), its tokens, the draft tokens the target accepted and alpha
    after it (None for the prefill and a plain step). The last chunk says why the generation ended and
    carries its `Completion`."""

    text: str
    tokens: list[int]
    accepted: int | None = None
    alpha: float | None = None
    finish_reason: str | None = None
    completion: Completion | None = None


def peak_rss_bytes(extra_pids_peak: int = 0) -> int:
    """Peak resident set of this process (and, if given, the peaks of its actors added)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + extra_pids_peak


def make_row(**fields) -> dict:
    """A row from its fields; tokens_per_s is derived from new_token_ids and wall_s."""
    missing = [f for f in ROW_FIELDS if f not in fields and f != "tokens_per_s"]
    if missing:
        raise ValueError(f"row is missing {missing}")
    n, wall = len(fields["new_token_ids"]), fields["wall_s"]
    fields["tokens_per_s"] = round(n / wall, 3) if wall > 0 else 0.0
    fields["wall_s"] = round(wall, 6)  # to the microsecond: tokens_per_s stays n / wall_s on a tiny model too
    fields["prefill_s"] = round(fields["prefill_s"], 6)
    return {k: fields[k] for k in ROW_FIELDS} | {k: v for k, v in fields.items() if k not in ROW_FIELDS}


def write_rows(path: str | Path, rows: list[dict]):
    """Write `rows` to `path` atomically. `--json` paths are checked before a run (`paths.check_output`);
    should the write still fail (a full disk), the rows go to a temporary file that the error names."""
    path = Path(path)
    text = "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n]\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        with tempfile.NamedTemporaryFile("w", prefix="cadence-rows-", suffix=".json", delete=False) as f:
            f.write(text)
        raise CadenceError(
            f"could not write {path} ({e.strerror or e}); the {len(rows)} rows were saved to {f.name} instead"
        ) from None
