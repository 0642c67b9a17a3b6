"""transformers' own builds from a GGUF, the outside reference the model tests compare with, kept under
$CADENCE_HOME/hf-reference: its GGUF loader dequantizes a model or rebuilds a tokenizer's vocabulary in Python
(10 to 60 s each), while what it built loads again in a second or two. Each is keyed by the GGUF's sha256 and
transformers' version, the two things it depends on; a build is written to a folder of its own and moved into
place whole, so a build that was cut short is never read."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from common import paths


def kept(gguf: Path, what: str, build: Callable[[Path], None], depends: str = "") -> Path:
    """The folder `build(folder)` writes for `gguf`'s `what`, built here the first time. The key: the GGUF's sha256,
    the versions of the packages that read it (transformers, tokenizers, gguf) and `depends` (what else the build
    depends on, e.g. the sources of the code that writes it)."""
    from importlib.metadata import version

    from formats.source import sha256_file

    h = hashlib.sha256(sha256_file(gguf).encode())
    h.update(" ".join([depends, *(version(p) for p in ("transformers", "tokenizers", "gguf"))]).encode())
    name = f"{gguf.stem}-{what}-{h.hexdigest()[:16]}"
    folder = paths.home() / "hf-reference" / name
    if (folder / "done").exists():
        return folder
    tmp = folder.with_name(f"{name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        (tmp / "done").write_text("")
        if (folder / "done").exists():  # another process finished the same build first
            return folder
        shutil.rmtree(folder, ignore_errors=True)  # a build cut short before its `done`
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "done").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a build that failed, or lost the race, leaves nothing
    return folder


def sources(*files: Path) -> str:
    """The sha256 of these files' text: a build's `depends` where code of the suite writes it."""
    return hashlib.sha256(b"".join(Path(f).read_bytes() for f in files)).hexdigest()


def hf_model(gguf: Path):
    """transformers' model of `gguf`, dequantized to fp32, in eval mode."""
    import torch
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    def build(folder: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (folder / "config.json").write_text(json.dumps(config))
        save_model(model, folder / "model.safetensors")

    folder = kept(gguf, "fp32", build)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    load_model(model, folder / "model.safetensors")
    return model.eval()


PROBES = ("Cafe\u0301 na\u0131ve \ufb01le", "  def f(x):\n\treturn x**2  # \u00e9t\u00e9", "\u4f60\u597d, world! 123")


def hf_tokenizer(gguf: Path):
    """transformers' own tokenizer of `gguf`: its `tokenizers` pipeline as transformers built it from the GGUF, kept
    as that pipeline's JSON and wrapped again (transformers' tokenizer classes add steps of their own when they load
    a folder: Qwen2's an NFC normalizer the GGUF's has not). The build checks the kept one encodes as the built one,
    decomposed text (NFD) included."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    def wrap(folder: Path):
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(folder / "tokenizer.json")))

    def build(folder: Path) -> None:
        built = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        built.backend_tokenizer.save(str(folder / "tokenizer.json"))
        again = wrap(folder)
        for text in PROBES:
            want = built(text, add_special_tokens=False)["input_ids"]
            assert again(text, add_special_tokens=False)["input_ids"] == want, f"the kept tokenizer differs on {text!r}"

    return wrap(kept(gguf, "tokenizer", build))


def hf_greedy(gguf: Path, model, seqs: list[list[int]], n: int) -> list[list[int]]:
    """`model`'s (transformers' own, of `gguf`) greedy `n` new tokens for each of `seqs`, generated in one
    left-padded batch (its positions come from the attention mask), no stop token, and kept (with torch's version
    and the prompts in the key)."""
    import torch

    key = hashlib.sha256(json.dumps([seqs, n, torch.__version__]).encode()).hexdigest()[:12]

    def build(folder: Path) -> None:
        width = max(map(len, seqs))
        inp = torch.tensor([[0] * (width - len(x)) + x for x in seqs])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in seqs])
        with torch.no_grad():
            out = model.generate(
                inp,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        (folder / "ids.json").write_text(json.dumps(out[:, width:].tolist()))

    return json.loads((kept(gguf, f"greedy-{key}", build) / "ids.json").read_text())
