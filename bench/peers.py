"""Other engines, each in a child process of its own (`python -m bench.baselines --serve`), so that a
peer that crashes (llama.cpp's native build dies of a general protection fault on a CPU with AMX)
becomes a row that says so, and every row measured before and after it is kept.

The child loads its engine once and answers one JSON line per prompt (the prompt's token ids in, a
row out); prompts still run one after another, every engine in turn, so the background load of a
shared machine falls on all of them alike.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from common.errors import CadenceError
from engine.prompts import Prompt
from engine.rows import make_row

AMX_HINT = (
    "on a CPU with AMX a native build of llama-cpp-python dies in ldtilecfg (it never asks the kernel for "
    'tile state); rebuild it without AMX: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON '
    "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX2=ON -DGGML_FMA=ON "
    '-DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install '
    "--force-reinstall --no-cache-dir llama-cpp-python"
)
LOAD_S = 600  # a peer that has not loaded by then is stuck


def has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


def death(name: str, returncode: int | None, stderr: str) -> str:
    """Why a peer's process ended, in one sentence (with the AMX build hint where it applies)."""
    if returncode is not None and returncode < 0:
        why = f"{name} crashed ({signal.Signals(-returncode).name})"
    else:
        why = f"{name} exited with code {returncode}"
    last = next((ln for ln in reversed(stderr.strip().splitlines()) if ln.strip()), "")
    if last:
        why += f": {last.strip()[:300]}"
    if name == "llama.cpp" and returncode in (-signal.SIGSEGV, -signal.SIGILL, -signal.SIGBUS) and has_amx():
        why += f"; {AMX_HINT}"
    return why


class Peer:
    """One engine in its own process: `run` a prompt, get a row (an `error` row once the peer is gone)."""

    def __init__(self, name: str, args: list[str]):
        self.name, self.error = name, None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.baselines", "--serve", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        line = self.proc.stdout.readline()  # {"ready": ...} once loaded
        if not line:
            self.error = self._death()
        elif "error" in json.loads(line):
            self.error = json.loads(line)["error"]

    def run(self, prompt: Prompt, mode: str, ids: list[int], chat: bool, max_new: int) -> dict:
        if self.error is None:
            try:
                self.proc.stdin.write(
                    json.dumps(
                        {
                            "id": prompt.id,
                            "kind": prompt.kind,
                            "mode": mode,
                            "ids": ids,
                            "chat": chat,
                            "max_new": max_new,
                        }
                    )
                    + "\n"
                )
                line = self.proc.stdout.readline()
            except BrokenPipeError:
                line = ""
            if line:
                return json.loads(line)
            self.error = self._death()
        return failed_row(prompt, mode, ids, chat, self.error)

    def _death(self) -> str:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return death(self.name, self.proc.returncode, self.proc.stderr.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def failed_row(prompt: Prompt, mode: str, ids: list[int], chat: bool, error: str) -> dict:
    """A row for a run that could not happen: no tokens, and why."""
    return make_row(
        id=prompt.id,
        kind=prompt.kind,
        mode=mode,
        target="",
        draft=None,
        format="",
        chat=chat,
        prompt_token_ids=ids,
        new_token_ids=[],
        text="",
        wall_s=0.0,
        prefill_s=0.0,
        peak_rss_bytes=0,
        stats={},
        error=error,
    )


def start_peers(
    names: list[str], target: str, draft: str | None, dtype: str, threads: int, hf_dtype: str, repack: bool
) -> dict[str, Peer]:
    """One process per engine family: `hf` serves hf, hf-assisted and hf-prompt-lookup."""
    base = ["--target", target, "--dtype", dtype, "--threads", str(threads)]
    peers = {}
    if any(n.startswith("hf") for n in names):
        peers["hf"] = Peer(
            "hf", [*base, "--engine", "hf", "--hf-dtype", hf_dtype, *(["--draft", draft] if draft else [])]
        )
    if "llama.cpp" in names:
        peers["llama.cpp"] = Peer("llama.cpp", [*base, "--engine", "llama.cpp", *([] if repack else ["--no-repack"])])
    for p in peers.values():
        if p.error:
            print(f"launch bench: {p.error}; its rows say so", file=sys.stderr, flush=True)
    return peers


def peer_of(name: str) -> str:
    return "hf" if name.startswith("hf") else name


def check_installed(names: list[str]) -> None:
    from bench.baselines import available

    for x in names:
        if not available(peer_of(x)):
            raise CadenceError(
                f"baseline {x} needs its package installed "
                f"({'transformers and accelerate' if x.startswith('hf') else 'llama-cpp-python'})"
            )
