"""Does the installed llama.cpp run the GGUF files our writer produces, and compute what transformers computes?

tests/models/test_families.py checks cadence's reading of each family's GGUF (bench/hf_gguf.py's writer, as
llama.cpp's converter writes it) against transformers in fp32; this checks the other side: llama.cpp's own C++ on
the same file. For every family and variant of tests/models/families.py that has a GGUF writer it builds the tiny
random HF model, writes the F32 GGUF, and feeds the token ids of PROMPT (from the HF folder's tokenizer.json) to
llama-cpp-python (`Llama(..., n_ctx=256, n_threads=1, logits_all=True)`, `eval`, every row of `scores`) in a child
process of its own, so that an architecture llama.cpp does not know, or an abort in its C++, is a row of the table
and not the end of the run. The logits are compared with transformers' (fp32, eager attention) and with cadence's
own forward from the same GGUF: the largest difference over all positions and tokens relative to the reference's
largest logit (max(1, |ref|)), and the share of positions whose greedy token agrees.

Variants whose GGUF is by design another model than HF's (the skip sets of tests/models/test_families.py: no
window, routed scale, chunk size or query temperature in the file, a Mamba-2 norm after the gate only) are marked;
for them only the cadence column says whether the file is read alike. So are the differences this check found in
llama.cpp itself (`LLAMA_CPP_DIFFERS`: a shape of the tiny model that llama.cpp's C++ assumes away, a rounding of
its own); none of them is in our writer. llama.cpp's KV cache is f32 here (its default, f16, adds ~1e-3 of
rounding by itself: `--kv f16` shows it). The child runs llama.cpp with verbose=True only so that an abort's
message reaches its captured stderr; the loader's log goes to a callback that keeps its warnings and errors.

    python -m bench.llama_cpp_families [--only MODEL_TYPE ...] [--work DIR] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
N_CTX = 256
KV = {"f32": 0, "f16": 1}  # ggml_type of the KV cache (llama.cpp's default is f16: ~1e-3 of rounding by itself)


@dataclass
class Row:
    model_type: str
    variant: str
    arch: str  # llama.cpp's general.architecture of the file
    loads: bool = False
    rel_hf: float | None = None  # llama.cpp against transformers
    argmax_hf: float | None = None  # % of positions whose greedy token agrees
    rel_cadence: float | None = None  # llama.cpp against cadence's forward from the same GGUF
    argmax_cadence: float | None = None
    cadence_rel_hf: float | None = None  # cadence (GGUF) against transformers, for reference
    note: str = ""  # why llama.cpp runs another model than HF's here (by design, or llama.cpp's own), or ""
    error: str = ""


# what llama.cpp (llama-cpp-python 0.3.36) does otherwise than transformers on these files, found by this check
LLAMA_CPP_DIFFERS = {
    ("gemma2", "plain"): "llama.cpp's CPU GELU is an fp16 table (ggml-cpu/vec.h GGML_GELU_FP16)",
    ("gemma2", "softcap"): "fp16 GELU table",
    ("gemma3_text", "plain"): "fp16 GELU table",
    ("gemma3_text", "linear"): "fp16 GELU table",
    ("gemma4_text", "plain"): "fp16 GELU table",
    ("gemma4_text", "moe"): "llama.cpp caps Gemma 4's logits at 30 when the GGUF has no final_logit_softcapping",
    ("gemma4_text", "ple"): "llama.cpp's Gemma 4 KV sharing assumes the last unshared layer is a full one",
    ("exaone4", "plain"): "llama.cpp's EXAONE 4 has a window (and NoPE full layers) only at 64 layers (the 32B)",
    ("gpt_oss", "plain"): "llama.cpp always truncates YaRN's ramp; gpt-oss says truncate false (as cadence runs it)",
    ("granitemoehybrid", "plain"): "llama.cpp's Granite hybrid asserts mamba_expand 2 (2 * n_embd == d_inner)",
    ("qwen3_5_text", "plain"): "the converter's default rope sections [11, 11, 10] exceed a head of 16",
    ("qwen3_5_moe_text", "plain"): "the converter's default rope sections [11, 11, 10] exceed a head of 16",
    ("qwen3_next", "plain"): "llama.cpp's Qwen3-Next wants experts in every layer (mlp_only_layers [1])",
}


def by_design_notes() -> dict[tuple[str, str], str]:
    """(model_type, variant) -> why its GGUF is another model than HF's (tests/models/test_families.py's sets)."""
    from tests.models import test_families as t

    sets = (
        (t.NO_WINDOW_IN_GGUF, "no sliding window in GGUF"),
        (t.NO_SCALE_IN_GGUF, "no routed scale in GGUF"),
        (t.NO_CHUNK_IN_GGUF, "chunks of 8192 in GGUF"),
        (t.NORM_AFTER_GATE_IN_GGUF, "Mamba-2 norm after gate in GGUF"),
        (t.NO_TEMP_IN_GGUF, "no query temperature in GGUF"),
    )
    notes = {case: f"by design: {why}" for cases, why in sets for case in cases}
    return {**{case: f"llama.cpp: {why}" for case, why in LLAMA_CPP_DIFFERS.items()}, **notes}


def compare(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |got - ref| / max(1, max |ref|), % of rows whose argmax agrees)."""
    rel = float(np.abs(got - ref).max()) / max(1.0, float(np.abs(ref).max()))
    return rel, 100.0 * float((got.argmax(-1) == ref.argmax(-1)).mean())


def worker(gguf: Path, ids: list[int], out: Path, kv: str = "f32") -> None:
    """In a child process: llama.cpp's logits of `ids`, every row, to OUT.npy; OUT.json says how far it got, with
    the loader's warnings and errors."""
    import llama_cpp

    log: list[str] = []
    last = [0]

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, _user) -> None:
        if level in (3, 4) or (level == 5 and last[0] in (3, 4)):  # ggml_log_level: WARN 3, ERROR 4, CONT 5
            log.append(text.decode("utf-8", "replace"))
        last[0] = level if level != 5 else last[0]

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))

    def say(**kw) -> None:
        (out.with_suffix(".json")).write_text(json.dumps({**kw, "log": "".join(log)[-3000:]}))

    say(stage="loading")
    try:
        kw = dict(n_ctx=N_CTX, n_threads=1, logits_all=True, verbose=True, type_k=KV[kv], type_v=KV[kv])
        llm = llama_cpp.Llama(model_path=str(gguf), **kw)
    except Exception as e:  # an architecture llama.cpp does not know, a key or tensor it wants and lacks
        say(stage="failed", error=f"{type(e).__name__}: {e}")
        return
    say(stage="loaded", arch=llm.metadata.get("general.architecture", ""))
    llm.eval(ids)
    np.save(out.with_suffix(".npy"), np.array(llm.scores[: len(ids)], dtype=np.float32))
    say(stage="done", arch=llm.metadata.get("general.architecture", ""))


def llama_cpp_logits(gguf: Path, ids: list[int], work: Path, kv: str) -> tuple[bool, np.ndarray | None, str]:
    """(loads?, logits or None, what went wrong) from llama.cpp in a child process."""
    out = work / "llama"
    (work / "ids.json").write_text(json.dumps(ids))
    cmd = [
        sys.executable,
        "-m",
        "bench.llama_cpp_families",
        "--worker",
        str(gguf),
        str(work / "ids.json"),
        str(out),
        kv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GGML_NO_BACKTRACE": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    state = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    stage = state.get("stage", "not started")
    if stage == "done":
        return True, np.load(out.with_suffix(".npy")), ""
    tail = [ln for ln in (state.get("log", "") + p.stderr).splitlines() if ln.strip()]
    why = state.get("error") or (f"exit {p.returncode} while {stage}" if p.returncode else f"stopped at {stage}")
    picks = [[ln for ln in tail if w in ln] for w in ("GGML_ASSERT", "error loading model", "error", "rror")]
    detail = next((p[-1] for p in picks if p), tail[-1] if tail else "").strip()
    detail = detail.split("/vendor/")[-1]  # not the build folder's path
    return stage in ("loaded", "done"), None, f"{why}: {detail}" if detail else why


def cadence_logits(gguf: Path, ids: list[int], work: Path) -> np.ndarray:
    """cadence's fp32 forward of `ids` from the GGUF (tests/models/test_families.py's `ours`)."""
    import torch

    from formats.source import GGUFSource
    from tests.models.test_families import ours

    model = ours(GGUFSource(gguf), work / "store")
    with torch.no_grad():
        got = model.forward(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))
    return got.float().numpy()


def hf_logits(folder: Path, model_type: str, ids: list[int]) -> np.ndarray:
    import torch

    from tests.models.families import causal_lm

    hf = causal_lm(model_type).from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def check_case(model_type: str, variant: str, work: Path, notes: dict, kv: str = "f32") -> Row:
    """One family's variant: built, written, run by llama.cpp, transformers and cadence, compared."""
    from bench.hf_gguf import GGUF_ARCH, write_gguf_like_llama_cpp
    from tests.models.families import tiny_hf
    from tests.models.test_families import prompt_ids

    work.mkdir(parents=True, exist_ok=True)
    row = Row(model_type, variant, GGUF_ARCH[model_type], note=notes.get((model_type, variant), ""))
    folder = tiny_hf(model_type, variant, work / "hf", 5)
    gguf = write_gguf_like_llama_cpp(folder, work / "m.gguf", "F32")
    ids = prompt_ids(folder)
    ref = hf_logits(folder, model_type, ids)
    row.loads, got, row.error = llama_cpp_logits(gguf, ids, work, kv)
    try:
        mine = cadence_logits(gguf, ids, work)
        row.cadence_rel_hf = compare(mine, ref)[0]
    except Exception as e:  # cadence refusing the file is a finding too
        mine, row.error = None, row.error or f"cadence: {type(e).__name__}: {e}"
    if got is not None:
        row.rel_hf, row.argmax_hf = compare(got, ref)
        if mine is not None:
            row.rel_cadence, row.argmax_cadence = compare(got, mine)
    return row


def cases(only: list[str] | None) -> list[tuple[str, str]]:
    from bench.hf_gguf import GGUF_ARCH
    from tests.models.families import VARIANTS

    return [(mt, v) for mt, vs in VARIANTS.items() if mt in GGUF_ARCH and (not only or mt in only) for v in vs]


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    head = (
        "| model_type | variant | llama.cpp arch | loads | rel diff vs HF | argmax vs HF | rel diff vs cadence "
        "| argmax vs cadence | cadence vs HF | note / error |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        note = "; ".join(x for x in (r.note, r.error) if x)
        lines.append(
            f"| {r.model_type} | {r.variant} | {r.arch} | {'yes' if r.loads else 'no'} | {_num(r.rel_hf, '.1e')} "
            f"| {_num(r.argmax_hf, '.0f')}% | {_num(r.rel_cadence, '.1e')} | {_num(r.argmax_cadence, '.0f')}% "
            f"| {_num(r.cadence_rel_hf, '.1e')} | {note.replace('|', '/')} |"
        )
    return "\n".join(lines).replace("| -% |", "| - |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(Path(argv[1]), json.loads(Path(argv[2]).read_text()), Path(argv[3]), argv[4])
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.llama_cpp_families", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="model_types to check (default: every one with a GGUF writer)")
    p.add_argument("--work", type=Path, help="where the models are built (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--kv", choices=KV, default="f32", help="llama.cpp's KV cache type (default f32: no rounding)")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    work = a.work or Path(tempfile.mkdtemp(prefix="llama-cpp-families-"))
    notes, rows = by_design_notes(), []
    for mt, v in cases(a.only):
        rows.append(check_case(mt, v, work / f"{mt}-{v}", notes, a.kv))
        r = rows[-1]
        print(f"{mt:17s} {v:17s} loads={r.loads} rel_hf={_num(r.rel_hf, '.1e')} {r.error}", file=sys.stderr)
        if a.json:
            a.json.write_text(json.dumps([asdict(x) for x in rows], indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
