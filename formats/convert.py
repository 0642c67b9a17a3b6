"""Convert a model source (GGUF / HF) into a weight store, once per source hash and format."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from rich.progress import Progress

from common import paths
from common.bars import count_bar
from common.errors import CadenceError
from common.settings import check_format
from pulls import registry
from common.files import no_space
from pulls.wheels import is_pulled, model_path, pull
from formats.store import WeightStore, StoreWriter

LINEAR = (
    "attn_qkv",
    "attn_out",
    "ffn_gate_up",
    "ffn_down",
    "head",
    "ffn_router",
    "ffn_shexp_gate",
    "ffn_shexp_gate_up",
    "ffn_shexp_down",
    "gate_up",
    "down",
    "conv_in",
    "conv_out",
    "attn_gate",
    "gdn_in",
    "gdn_out",
    "ssm_in",
    "ssm_out",
    "attn_q_a",
    "attn_q",
    "attn_kv_a",
    "attn_kv_b",
    "ple_proj",
    "ple_gate",
    "ple_out",
)
# kept in fp32 whatever the format: a router decides which experts run, and its weights are a few KiB per layer
FP32_LINEAR = ("ffn_router", "ffn_shexp_gate")
# kept in int4 by the model format int2 (only its FFN products are in 2 bits): the 0.5B draft's top-1 agreement
# with the 1.5B, 0.91 in int4, is 0.84 with its FFN in int2 and 0.66 with its attention too
INT4_IN_INT2 = ("attn_qkv", "attn_out", "head", "attn_q_a", "attn_q", "attn_kv_a", "attn_kv_b")


def is_linear(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LINEAR


def linear_format(name: str, fmt: str, expert_formats: dict | None = None) -> str:
    """The format a linear tensor is stored in: fp32 for routers; an expert's own (expert-wise bitwidth,
    `expert_formats[(layer, expert)]`) where one was chosen; else the store's (a store in int2: int4 for its
    attention and head)."""
    part = name.split(".")
    if part[-1] in FP32_LINEAR:
        return "fp32"
    if expert_formats and len(part) == 5 and part[2] == "exp":
        return expert_formats.get((int(part[1]), int(part[3])), fmt)
    if fmt == "int2" and part[-1] in INT4_IN_INT2:
        return "int4"
    return fmt


def convert(
    source,
    out_dir: Path,
    fmt: str,
    *,
    group_size: int = 32,
    label: str = "",
    progress: Progress | None = None,
    expert_formats: dict | None = None,
    encoded: dict | None = None,
) -> Path:
    """Write `source` as a weight store at `out_dir` (atomically: a `.partial` dir renamed at the end), under
    the store's lock (`store_lock`). `expert_formats`: {(layer, expert): format} for experts stored at their
    own bitwidth (EdgeMoE §3.2); `encoded`: {(tensor, format): (arrays, meta)} already encoded
    (formats/bitwidth.py), written as they are."""
    with store_lock(out_dir):
        return _write_store(source, out_dir, fmt, group_size, label, progress, expert_formats, encoded)


def _write_store(
    source,
    out_dir: Path,
    fmt: str,
    group_size: int,
    label: str,
    progress: Progress | None = None,
    expert_formats: dict | None = None,
    encoded: dict | None = None,
) -> Path:
    from formats.source import canonical_names

    check_format(fmt)
    args = source.args
    if getattr(source, "wrapper", ""):
        _stderr(f"{source.wrapper} is a multimodal model: cadence converts and runs its text model; images are not run")
    # the head is written in parts, below; the final norm goes with the first part
    names = [("head.0" if g == "head" else g, n) for g, n in canonical_names(args) if n != "head"]
    starts = head_part_starts(args)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    writer = StoreWriter(tmp)
    own = progress is None
    progress = progress or count_bar()
    task = progress.add_task(f"convert {label or out_dir.name} -> {fmt}", total=len(names) + len(starts))
    t0 = time.time()
    try:
        if own:
            progress.start()
        _write_tensors(
            writer, source, names, starts, fmt, group_size, expert_formats, encoded, lambda: progress.advance(task)
        )
        writer.finish(
            {
                "model": args.to_dict(),
                "format": fmt,
                "group_size": group_size,
                **(
                    {"expert_formats": sorted([l, e, f] for (l, e), f in expert_formats.items())}
                    if expert_formats
                    else {}
                ),
                "source": {"kind": source.kind, "path": str(source.path), "sha256": source.identity()},
                "convert_seconds": round(time.time() - t0, 1),
            },
            source.tokenizer,
        )
    except BaseException as e:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        full = no_space(e, out_dir) if isinstance(e, OSError) else None
        if full is not None:
            raise full from None
        raise
    finally:
        if own:
            progress.stop()
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _write_tensors(
    writer: StoreWriter,
    source,
    names: list,
    starts: list[int],
    fmt: str,
    group_size: int,
    expert_formats: dict | None,
    encoded: dict | None,
    advance,
) -> None:
    """Every tensor of `source` into `writer`, in the store's group order; `advance()` after each."""
    import torch

    from models import linear

    args = source.args
    for group, name in names:
        f = linear_format(name, fmt, expert_formats) if is_linear(name) else ""
        if encoded and (name, f) in encoded:
            writer.add(group, name, f, *encoded[name, f])
        elif is_linear(name):
            arrays, meta = linear.encode(torch.from_numpy(source.get(name)), f, group_size=group_size)
            writer.add(group, name, f, arrays, meta)
        else:
            dtype = linear.float_dtype(fmt) if name in ("embed", "embed_pl") else torch.float32
            writer.add(group, name, "float", {"w": torch.from_numpy(source.get(name)).to(dtype)})
        advance()
    # The output head in parts of about a layer's bytes, each a group of its own: streamed, a part fits the
    # slots a layer does; and a tied model gets a head of its own (the embedding stays on disk under a budget,
    # read row by row). Rows are quantized independently: the parts' bits are the whole head's.
    head = torch.from_numpy(source.get("embed" if args.tied_embeddings else "head"))
    for j, (lo, hi) in enumerate(zip(starts, [*starts[1:], args.vocab_size])):
        f = linear_format("head", fmt)
        arrays, meta = linear.encode(head[lo:hi], f, group_size=group_size)
        writer.add(f"head.{j}", f"head.{j}", f, arrays, {**meta, "rows": [lo, hi]})
        advance()


@contextmanager
def store_lock(out_dir: Path, say=None):
    """Hold the lock of the weight store at `out_dir` (`<store>.lock` beside it, holding its holder's pid): one
    process at a time writes a store's `.partial` folder. Another waits for it, saying so in one line through
    `say` (default: stderr). The kernel drops the lock of a process that dies, SIGKILL included, so a lock
    left by a killed converter is taken over at once (and its `.partial` folder written afresh)."""
    paths.writable_dir(out_dir.parent)
    fd = os.open(out_dir.with_name(out_dir.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    held = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 16, 0).decode(errors="replace").strip() or "?"
            (say or _stderr)(f"waiting for process {holder}, which is converting the same model into {out_dir}")
            fcntl.flock(fd, fcntl.LOCK_EX)  # no timeout: a conversion takes as long as it takes; Ctrl-C ends the wait
        held = True
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        if held:
            os.ftruncate(fd, 0)
        os.close(fd)  # lets go of the lock


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


HEAD_ROW_ALIGN = 256


def head_part_starts(args) -> list[int]:
    """First token row of each output-head part: as many parts as the head has layers' worth of
    weights (rounded), rows a multiple of 256."""
    layer = args.layer_params()
    n = max(1, round(args.vocab_size * args.dim / layer))
    rows = -(-args.vocab_size // n)
    rows = -(-rows // HEAD_ROW_ALIGN) * HEAD_ROW_ALIGN
    return list(range(0, args.vocab_size, rows))


def _hash_index() -> Path:
    return paths.stores_dir() / "source-hashes.json"


def source_identity(path: Path) -> str:
    """sha256 of a model file, cached by (path, size, mtime) so a large file is hashed once."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    idx_path = _hash_index()
    try:
        idx = json.loads(idx_path.read_text())
    except (OSError, json.JSONDecodeError):
        idx = {}
    if key not in idx:
        from formats.source import sha256_file

        idx[key] = sha256_file(path) if path.is_file() else open_source(path).identity()
        try:
            idx_path.parent.mkdir(parents=True, exist_ok=True)
            idx_path.write_text(json.dumps(idx))
        except OSError:
            pass  # a cache: a home we cannot write still runs the stores it has (a conversion says why it cannot)
    return idx[key]


def resolve(model: str) -> tuple[str, Path, str]:
    """(label, source path, source sha256) for a registry name, a hub model (hf:OWNER/REPO[:FILE]) or a path;
    pulls registry and hub models not yet pulled."""
    from pulls import hub

    if model in registry.MODELS:
        spec = registry.spec(model)
        if not is_pulled(spec):
            pull(spec)
        return spec.name, model_path(spec), spec.sha256
    if hub.is_ref(model):
        ref = hub.parse(model)
        path = hub.pull(ref)  # nothing to do once pulled: it resolves without the network
        return ref.label, path, hub.recorded_sha256(ref) or source_identity(path)
    path = Path(model).expanduser()
    if not path.exists():
        registry.spec(model)  # raises the "unknown model" sentence for names that are not paths
    return path.stem if path.is_file() else path.name, path, source_identity(path)


def store_dir(label: str, sha: str, fmt: str) -> Path:
    return paths.stores_dir() / f"{label}-{fmt}-{sha[:12]}"


def ensure_store(model: str, fmt: str, group_size: int = 32, say=None) -> WeightStore:
    """The weight store of `model` in `fmt`, converting it on first use. A process that finds another one
    converting the same store waits for it (one line through `say`, see `store_lock`) and uses its store."""
    check_format(fmt)
    given = Path(model).expanduser()
    if given.is_dir() and (given / "manifest.json").exists():  # a weight store itself (e.g. expert-wise bitwidths)
        return WeightStore(given)
    label, path, sha = resolve(model)
    out = store_dir(label, sha, fmt if fmt not in ("int4", "int2") else f"{fmt}g{group_size}")
    if not _current(out):  # missing, or written by another version of cadence (a cache): convert, replacing it
        paths.writable_dir(out.parent)
        if "torch" in sys.modules:
            with store_lock(out, say):
                if not _current(out):  # the process this one waited for wrote it
                    _write_store(open_source(path, sha), out, fmt, group_size, label)
        else:
            _convert_in_child(model, fmt, group_size)
    return WeightStore(out)


def _convert_in_child(model: str, fmt: str, group_size: int) -> None:
    """Convert in a child process: a conversion needs torch, and a process that has none (the
    scheduler of a run: its memory counts against the budget) must not carry it for the rest of
    the run. The child's progress bars and its one-sentence error reach the user as they are."""
    from shm.watchdog import python_env

    p = subprocess.run(
        [sys.executable, "-m", "formats.convert", model, fmt, str(group_size)],
        env=python_env(),
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr,
        stderr=subprocess.PIPE,
        text=True,
    )
    if p.returncode != 0:
        if p.returncode < 0:  # a signal: in a memory cgroup smaller than the conversion needs, the kernel's OOM kill
            raise CadenceError(
                f"converting {model} to {fmt} was killed (signal {-p.returncode}), most likely for memory: a conversion "
                f"holds the model's unquantized weights, more than a small memory limit allows; convert it once where "
                f"memory allows (`launch models convert {model} --dtype {fmt} --group-size {group_size}`), then run"
            )
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        raise CadenceError(
            lines[-1].removeprefix("convert: ")
            if lines
            else f"converting {model} to {fmt} failed (exit code {p.returncode})"
        )
    sys.stderr.write(p.stderr)


def _current(store: Path) -> bool:
    from formats.store import FORMAT_VERSION

    try:
        return json.loads((store / "manifest.json").read_text()).get("format_version") == FORMAT_VERSION
    except (OSError, json.JSONDecodeError):
        return False


def known_stores() -> list[WeightStore]:
    root = paths.stores_dir()
    stores = []
    for d in sorted(root.glob("*")) if root.exists() else []:
        if (d / "manifest.json").is_file():
            try:
                stores.append(WeightStore(d))
            except CadenceError:
                pass
    return stores


def main(argv: list[str]) -> int:
    """`python -m formats.convert MODEL FORMAT GROUP_SIZE`: what `ensure_store` runs in a child. Its stdout is
    the parent's stderr, as it goes: the line saying it waits for another conversion goes there."""
    try:
        ensure_store(argv[0], argv[1], int(argv[2]), say=lambda line: print(line, flush=True))
    except CadenceError as e:
        print(f"convert: {e}", file=sys.stderr)
        return 1
    return 0


def open_source(path: Path, sha256: str | None = None):
    """A model's source: an HF directory, else a GGUF file."""
    from formats.source import GGUFSource
    from formats.source_hf import HFSource

    path = Path(path)
    if path.is_dir():
        return HFSource(path)
    return GGUFSource(path, sha256)


if __name__ == "__main__":
    import torch  # noqa: F401  (imported first: this process converts in itself)

    sys.exit(main(sys.argv[1:]))
