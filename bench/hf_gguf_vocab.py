"""The tokenizer part of a GGUF as llama.cpp's converter writes it for a byte-level BPE (TextModel._set_vocab_gpt2
and gguf-py's SpecialVocab), for bench/hf_gguf.py."""

from __future__ import annotations

import json
from pathlib import Path


def _looks_special(tok: str) -> bool:
    """TextModel.does_token_look_special."""
    return (
        tok in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (tok.startswith("<|") and tok.endswith("|>"))
        or (tok.startswith("<｜") and tok.endswith("｜>"))
        or (tok.startswith("<unused") and tok.endswith(">"))
    )


def vocab_gpt2(w, folder: Path, h: dict, pre_tokenizers: dict) -> None:
    """TextModel._set_vocab_gpt2 (get_vocab_base): one token per id up to vocab_size, then the special vocab."""
    import gguf

    tj = json.loads((folder / "tokenizer.json").read_text())
    added = {t["id"]: t for t in tj["added_tokens"]}
    rev = {i: t for t, i in tj["model"]["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    tokens, types = [], []
    for i in range(h["vocab_size"]):
        tok = rev.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if i not in added:
            types.append(gguf.TokenType.NORMAL)
        elif added[i]["special"] or _looks_special(tok):
            types.append(gguf.TokenType.CONTROL)
        else:
            tok = tok.replace("\u2581", " ")
            types.append(gguf.TokenType.USER_DEFINED)
        tokens.append(tok)
    pre = tj["pre_tokenizer"]
    split = pre["pretokenizers"][0] if pre and pre.get("type") == "Sequence" else pre
    if not split or split.get("type") != "Split" or split["pattern"].get("Regex") not in pre_tokenizers:
        raise NotImplementedError(f"no llama.cpp pre-tokenizer name known for {split}")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizers[split["pattern"]["Regex"]])
    w.add_token_list(tokens)
    w.add_token_types(types)
    _special_vocab(w, folder, tj)


def _special_vocab(w, folder: Path, tj: dict) -> None:
    """gguf.SpecialVocab(load_merges=True) as llama.cpp's gguf-py has it, for tokenizers with no post-processor
    template: merges, special ids (tokenizer_config.json first, then config.json), add_*_token, chat template."""
    merges = tj["model"].get("merges") or []
    if merges and not isinstance(merges[0], str):  # pairs: spaces inside a part written as U+0120
        merges = [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in p) for p in m) for m in merges]
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    cfg = json.loads((folder / "config.json").read_text())
    add: dict[str, bool] = {}
    if pp := tj.get("post_processor"):
        for proc in pp.get("processors", [pp]):
            if proc.get("type") != "ByteLevel":
                raise NotImplementedError(f"post-processor {proc.get('type')} is not reproduced here")
            add.setdefault("bos", False)
            add.setdefault("eos", False)
    ids: dict[str, int] = {}
    for typ in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
        if isinstance(flag := tc.get(f"add_{typ}_token"), bool):
            add.setdefault(typ, flag)
        entry = tc.get(f"{typ}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        tid = next((t["id"] for t in tj["added_tokens"] if t["content"] == content), None)
        if isinstance(content, str) and isinstance(tid, int):
            ids.setdefault(typ, tid)
    for typ in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
        if isinstance(tid := cfg.get(f"{typ}_token_id", cfg.get("text_config", {}).get(f"{typ}_token_id")), int):
            ids.setdefault(typ, tid)
    if merges:
        w.add_token_merges(merges)
    for typ, tid in ids.items():
        getattr(w, f"add_{typ}_token_id")(tid)
    for typ, flag in add.items():
        getattr(w, f"add_add_{typ}_token")(flag)
    template = tc.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is not None:
        w.add_chat_template(template)
