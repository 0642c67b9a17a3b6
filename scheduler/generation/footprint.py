"""What the runtime's own processes hold on this machine: measured once, cached, never guessed.

A memory plan is only as good as its fixed part. The model actors fork from one zygote that has
imported torch, the kernels and the model code (actors/zygote.py), so those pages are held once;
each actor then adds its own private pages (thread stacks, zmq, the pages of shared objects it
writes to). `calibrate` measures both in a throwaway zygote and one forked child that does what
an actor does before its first op (a zmq socket, its thread pool, a kernel call), and the
watchdog, which is a plain interpreter. The result is cached under $CADENCE_HOME keyed by the
Python, the torch build and cadence's own sources: any of them changing measures again.

What a cgroup charges is anonymous memory plus shared memory plus the page cache; the page
cache is reclaimable, but the processes' code pages (libtorch, libpython, the kernels) are read
back from disk whenever they are reclaimed, so the plan also leaves room for the code pages a run
keeps touching (`code`), measured as the file-backed resident pages of the zygote and its child.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from common.calibration import cached, child_json
from common.settings import PREFILL_CHUNK
from scheduler.generation.memplan import Overheads, align
from scheduler.ledger import rollup

MiB = 1 << 20
VERSION = 2
# the modules the model actors need; the zygote imports them before the first fork
ACTOR_MODULES = ("actors.verifier", "actors.draft", "actors.loader")
_SOURCES = ("actors", "common", "text", "pulls", "models", "formats", "flash", "speculative", "cadence", "shm")
_SOURCES += ("scheduler",)


@dataclass(frozen=True)
class Footprint:
    zygote: int  # anonymous memory of the zygote after its imports (shared by every actor)
    actor: int  # private anonymous memory a forked actor adds before any model data
    watchdog: int  # the watchdog process (a small interpreter of its own)
    code: int  # file-backed pages (code) the zygote and an actor keep resident


def own_anon_bytes() -> int:
    """This process's anonymous memory (RssAnon: what a cgroup charges it, file pages aside)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssAnon"))
    except (OSError, StopIteration):
        return 0


def private_anon_bytes(pid: int | str = "self") -> int:
    """Anonymous pages only this process maps (a forked child: what it copied or allocated itself)."""
    total = 0
    anon = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    parts = line.split()
                    anon = len(parts) < 6 or parts[5].startswith("[")  # [heap], [stack], [anon:...] or no file
                elif anon and line.startswith(("Private_Dirty:", "Private_Clean:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


_PROBE = r"""
import json, os, sys
import actors.zygote as z
from scheduler.generation.footprint import own_anon_bytes, private_anon_bytes
from scheduler.ledger import rollup
z.preload(sys.argv[1:])
zygote = own_anon_bytes()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    import torch, zmq
    from actors import wire
    from actors.tracing import Tracer
    from common.heap import trim_heap
    from models.args import ModelArgs
    from models.transformer import Transformer
    from formats.weights import TensorWeights, random_tensors
    ctx = zmq.Context(); sock = ctx.socket(zmq.DEALER)
    torch.set_num_threads(max(2, os.cpu_count() or 1))
    # what an actor does before and between its ops: a tiny int4 model's forwards, the wire, the tracer
    args = ModelArgs(arch="qwen2", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                     norm_eps=1e-6, rope_base=1e4, context_length=64, qkv_bias=True, tied_embeddings=False)
    model = Transformer(args, TensorWeights(args, random_tensors(args), "int4"))
    cache = model.new_cache(32)
    tracer = Tracer(True)
    for t in (4, 1, 1, 5):
        with tracer.span("forward", cat="probe"):
            model.forward(torch.arange(t), torch.arange(cache.end, cache.end + t), cache).argmax(-1)
        cache.commit()
        wire.encode(wire.Reply(1, True, {"path": [1, 2], "next": 3}, {}))
    tracer.drain()
    trim_heap()
    file = rollup()
    os.write(w, json.dumps({"actor": private_anon_bytes(),
                            "code": file.get("Rss", 0) - file.get("Anonymous", 0) - file.get("Shmem", 0)}).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 4096))
os.waitpid(pid, 0)
print(json.dumps({"zygote": zygote, **child}))
"""


def _key() -> str:
    """Python, torch build and cadence sources: what the measurement depends on."""
    from shm.watchdog import REPO_ROOT

    h = hashlib.sha256(f"{VERSION} {sys.version} {sys.executable}".encode())
    for d in _SOURCES:
        for f in sorted(Path(REPO_ROOT, d).glob("*.py")):
            h.update(f.name.encode() + f.read_bytes())
    try:
        import importlib.metadata as md

        h.update(md.version("torch").encode())
    except Exception:  # noqa: BLE001 - no metadata: the sources and Python still key it
        pass
    return h.hexdigest()[:16]


def _measure_watchdog() -> int:
    import os
    import time

    from shm.watchdog import python_env

    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shm.watchdog", "1x0", str(os.getpid()), str(r)],
        pass_fds=(r,),
        stdin=subprocess.DEVNULL,
        env=python_env(),
    )
    os.close(r)
    try:
        time.sleep(0.3)  # it imports, then blocks reading the pipe
        return rollup(proc.pid).get("Anonymous", 0)
    finally:
        os.write(w, b"bye\n")
        os.close(w)
        proc.wait(5)


def calibrate() -> Footprint:
    """Measure the runtime's processes now (a few seconds: one interpreter imports torch)."""
    from shm.watchdog import python_env

    got = child_json(
        [sys.executable, "-c", _PROBE, *ACTOR_MODULES],
        "measuring the runtime's memory",
        "; check that `python -c 'import torch'` works in this environment",
        env=python_env(),
    )
    return Footprint(
        zygote=int(got["zygote"]), actor=int(got["actor"]), watchdog=_measure_watchdog(), code=int(got["code"])
    )


def footprint() -> Footprint:
    """This machine's footprint, from the cache under $CADENCE_HOME or measured now (and cached)."""
    return cached(
        "footprint",
        _key(),
        lambda: {"footprint": asdict(calibrate()), "python": sys.version, "modules": ACTOR_MODULES},
        lambda d: Footprint(**d["footprint"]),
    )


# -- the overheads of a run, for the memory plan -----------------------------------------------------

TRACE_EVENT_BYTES = 640  # a trace event as the scheduler keeps it (a dict of ~8 fields), measured


def activation_bytes(
    args: dict, rows_prefill: int, rows_verify: int, greedy: bool = True, head_rows: int = 0, head_part: int = 0
) -> int:
    """A forward's largest transient tensors (fp32): in a layer, the residual, the norm's output,
    the FFN's gate|up and its product (or q/k/v and the attention output), int8 copies of the
    inputs; after it, the logits, and with sampling one row's scores at a time. `rows_prefill`: rows of a
    prefill chunk (only its last row gets logits); `rows_verify`: rows of a verification (all get
    logits). `args`: a ModelArgs dict. `head_rows`: a draft's cut head (its logits are that wide);
    `head_part`: the rows of the largest part of a target's head (its greedy passes hold one part's
    logits at a time, `models.sampling.HeadArgmax`; 0: the whole row's)."""
    a = args
    q, kv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]
    per_row = 4 * max(2 * a["dim"] + 3 * a["ffn_dim"], 2 * a["dim"] + 2 * q + 2 * kv + q) + a["dim"] + a["ffn_dim"]
    if a.get("n_experts"):  # a row's experts, one after another: its input, gate|up, product and output each, the
        # router's logits and probabilities, the layer's output (measured: the heap keeps what they used)
        e = a["expert_ffn_dim"]
        per_row += 4 * (
            a["n_experts_used"] * (2 * a["dim"] + 3 * e)
            + 2 * a["n_experts"]
            + a["dim"]
            + 3 * (a.get("shared_ffn_dim") or 0)
        )
    gdn = a.get("gdn_v_heads", 0) * a.get("gdn_k_dim", 0) * a.get("gdn_v_dim", 0) if a.get("gdn_layers") else 0
    ssm = a.get("ssm_heads", 0) * a.get("ssm_head_dim", 0) * a.get("ssm_state", 0) if a.get("ssm_layers") else 0
    # recurrent states (models/recurrent.py): each node of a verification steps its own, and a forward keeps every
    # layer's last for the next forward's fold
    states = 4 * (gdn + ssm) * (rows_verify + len(a.get("gdn_layers") or a.get("ssm_layers") or ()))
    width = head_rows or a["vocab_size"]
    scoring = 0  # what choosing from one row's logits holds beside them (the rows are chosen one at a time)
    if not greedy:  # every row's logits; one row's penalized copy, fp64 log-probabilities, noise and nucleus at once
        logits, scoring = 4 * width, 48 * width
    elif head_part and not head_rows:  # the target's greedy token, one head part's logits at a time
        logits = 4 * head_part
    else:  # the logits and their softmax (a draft's confidence), as wide as the head
        logits = 8 * width
    return align(max(rows_prefill * per_row + logits, rows_verify * (per_row + logits)) + scoring + states)


def measure_overheads(
    target_args: dict,
    draft_args: dict | None = None,
    *,
    width: int = 8,
    context: int = 1024,
    greedy: bool = True,
    draft_window: int = 64,
    draft_vocab: int = 0,
    head_part: int = 0,
    trie_nodes: int = 0,
    trace_events: int = 0,
    own: int | None = None,
    batch_rows: int = 0,
    grammar: int = 0,
    prompt_cache: int = 0,
) -> Overheads:
    """The overheads of a run on this machine: the scheduler as this process holds it now (call it
    once the tokenizer is loaded; `own`: its anonymous bytes read once already) plus its trace buffer, the zygote's and each actor's own pages as
    calibrated once (scheduler/generation/footprint.py), activations from the models' shapes. `batch_rows`: with
    --parallel, the other generations' tree rows that ride in a forward with a prompt's chunk
    (speculative/batch.py: the prompts a cycle admits fill at most a chunk). `greedy`: each token a plain argmax
    (models/sampling.py), where a verification holds one head part's logits at a time, not every row's. `grammar`:
    what the processes that match grammars hold of the vocabulary (speculative/grammar.py `vocabulary_bytes`);
    `prompt_cache`: the prompt cache's memory (speculative/prefixes.py)."""
    fp = footprint()
    rows = min(width, 256) + 1 + 4  # a tree (or a batch of trees), its root and trie candidates
    prefill = min(context, PREFILL_CHUNK) + batch_rows
    return Overheads(
        scheduler=align(
            (own_anon_bytes() if own is None else own) + trace_events * TRACE_EVENT_BYTES + 4 * MiB
        ),  # + monitor and sockets
        watchdog=align(fp.watchdog),
        runtime=align(fp.zygote),
        actor=align(fp.actor),
        exchange=align(MiB),  # the arena's exchange part: what travels beside a message (no model's rows)
        verifier_activations=activation_bytes(target_args, prefill, rows, greedy, head_part=head_part),
        draft_activations=0
        if draft_args is None
        else activation_bytes(draft_args, min(prefill, draft_window or prefill), rows, greedy, draft_vocab)
        + trie_nodes * TRIE_NODE_BYTES,
        code=align(fp.code),
        grammar=align(grammar),
        prompt_cache=align(prompt_cache),
    )


TRIE_NODE_BYTES = 360  # a TokenTrie node (speculative/trie.py): object, dict, count
