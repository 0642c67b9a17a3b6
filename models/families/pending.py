"""The architectures of 2026 cadence does not run yet, by their HF `model_type` and llama.cpp architecture, each with
what it needs that the block lacks: a model of one is refused in one sentence naming that part, rather than with a
bare "not supported" (issue 54). A family that comes to run leaves this table."""

from __future__ import annotations

_NEEDS = {
    "Nemotron-3's experts (a sigmoid router with a selection bias over relu^2 experts)": ((), ("nemotron_h_moe",)),
}
HF_NEEDS = {t: need for need, (hf, _) in _NEEDS.items() for t in hf}
GGUF_NEEDS = {a: need for need, (_, gguf) in _NEEDS.items() for a in gguf}


def pending(kind: str, name: str) -> str:
    """' (it needs ...)' for an architecture this table knows (`kind`: "hf" or "gguf"), else ''."""
    need = (HF_NEEDS if kind == "hf" else GGUF_NEEDS).get(name)
    return f" yet: it needs {need}" if need else ""
