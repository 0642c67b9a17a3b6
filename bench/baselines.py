"""Other engines on the same models and prompts, for `launch bench`: HF transformers and llama.cpp.

Each baseline produces the same JSON rows as our modes (mode names `hf`, `hf-assisted`,
`hf-prompt-lookup`, `llama.cpp`), generating from the same prompt token ids with greedy decoding.
Both are optional: a baseline whose package is not installed is skipped with a note.
"""

from __future__ import annotations

import importlib.util
import json
import time

from engine.rows import make_row, peak_rss_bytes
from formats.convert import resolve

HF_MODES = ("hf", "hf-assisted", "hf-prompt-lookup")


def available(name: str) -> bool:
    mod = {"hf": "transformers", "llama.cpp": "llama_cpp"}[name]
    return importlib.util.find_spec(mod) is not None and (
        name != "hf" or importlib.util.find_spec("accelerate") is not None
    )


class HFBaseline:
    """transformers loading the same GGUF files (dequantized to `dtype`)."""

    def __init__(self, target: str, draft: str, dtype: str = "bf16"):
        import torch
        from transformers import AutoModelForCausalLM

        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
        self.dtype_name = dtype

        def load(name):
            _, path, _ = resolve(name)
            return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=self.dtype).eval()

        self.target, self.draft_name, self.target_name = load(target), draft, target
        self.draft = load(draft) if draft else None

    def run(self, peer: str, prompt, ids: list[int], chat: bool, max_new: int, stop_ids: set[int], decode) -> dict:
        kwargs = {}
        if peer == "hf-assisted":
            kwargs["assistant_model"] = self.draft
        elif peer == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        import torch

        inp = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.target.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=sorted(stop_ids),
                pad_token_id=sorted(stop_ids)[0],
                **kwargs,
            )
        wall = time.perf_counter() - t0
        new = out[0, len(ids) :].tolist()
        draft = self.draft_name if peer == "hf-assisted" else None
        return _row(prompt, peer, self.target_name, draft, f"hf-{self.dtype_name}", chat, ids, new, decode, wall)


class LlamaCppBaseline:
    """llama-cpp-python on the same GGUF file, 2 threads (mmap; `no_repack` for memory-limited runs)."""

    def __init__(self, target: str, threads: int, n_ctx: int = 2048, repack: bool = True):
        from llama_cpp import Llama

        import llama_cpp.llama_cpp as llama_cpp  # the module Llama() takes its default parameters from

        _, path, _ = resolve(target)
        self.name = target
        default_params = llama_cpp.llama_model_default_params
        if not repack:  # llama.cpp's --no-repack: llama-cpp-python has no argument for it, so set the field

            def no_repack():
                params = default_params()
                params.use_extra_bufts = False
                return params

            llama_cpp.llama_model_default_params = no_repack
        try:
            self.llm = Llama(
                model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False
            )
        finally:
            llama_cpp.llama_model_default_params = default_params

    def run(
        self, prompt, ids: list[int], chat: bool, max_new: int, stop_ids: set[int], decode, grammar: str = ""
    ) -> dict:
        """Greedy decoding through llama.cpp's own C API: `llama_decode` and its greedy sampler (after its grammar
        sampler where `grammar`, a GBNF text, holds the output, as llama-server's `grammar` does). The wrapper's
        `generate` samples in Python over a copy of the whole logits row, which for a 262k vocabulary (Gemma)
        costs more than the model's forward (BENCHMARKS.md, "The llama.cpp baseline now decodes through llama.cpp's
        own C API")."""
        import llama_cpp as lc

        llm = self.llm
        llm.reset()
        ctx = llm.ctx
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        smpl = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if grammar:
            vocab = lc.llama_model_get_vocab(llm.model)
            lc.llama_sampler_chain_add(smpl, lc.llama_sampler_init_grammar(vocab, grammar.encode(), b"root"))
        lc.llama_sampler_chain_add(smpl, lc.llama_sampler_init_greedy())
        step = llm.n_batch  # a prompt goes in chunks of what one llama_decode takes
        batch = lc.llama_batch_init(step, 0, 1)
        new: list[int] = []
        try:
            t0 = time.perf_counter()
            for s in range(0, len(ids), step):
                _decode(ctx, batch, ids[s : s + step], s)
            while True:
                tok = int(lc.llama_sampler_sample(smpl, ctx, -1))
                new.append(tok)
                if tok in stop_ids or len(new) >= max_new:
                    break
                _decode(ctx, batch, [tok], len(ids) + len(new) - 1)
            wall = time.perf_counter() - t0
        finally:
            lc.llama_batch_free(batch)
            lc.llama_sampler_free(smpl)
        return _row(prompt, "llama.cpp", self.name, None, "gguf", chat, ids, new, decode, wall)


def _decode(ctx, batch, tokens: list[int], pos0: int) -> None:
    """One llama_decode of `tokens` at positions pos0.., logits for the last only."""
    import llama_cpp as lc

    batch.n_tokens = len(tokens)
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i == len(tokens) - 1
    if lc.llama_decode(ctx, batch) != 0:
        raise RuntimeError(f"llama_decode failed at position {pos0}")


def _row(prompt, mode, target, draft, fmt, chat, ids, new, decode, wall) -> dict:
    """A peer's row, in the fields of ours (engine/rows.py): no prefill time of its own, no stats."""
    return make_row(
        id=prompt.id,
        kind=prompt.kind,
        mode=mode,
        target=target,
        draft=draft,
        format=fmt,
        chat=chat,
        prompt_token_ids=ids,
        new_token_ids=new,
        text=decode(new),
        wall_s=wall,
        prefill_s=0.0,
        peak_rss_bytes=peak_rss_bytes(),
        stats={},
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.baselines --target T ...`, in a process that imports neither torch (llama.cpp) nor
    our runtime: `--prompts P.jsonl --json OUT` runs llama.cpp on a prompt set (what `launch bench
    --cgroup` runs under the limit, so that llama.cpp is charged for llama.cpp and a tokenizer, nothing
    else); `--serve` loads one engine and answers a JSON line per prompt (bench/peers.py)."""
    import argparse
    import os
    import sys

    from common.errors import CadenceError
    from formats.convert import ensure_store
    from text.tokenizer import TextTokenizer

    p = argparse.ArgumentParser(prog="python -m bench.baselines")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None, help="hf-assisted's draft")
    p.add_argument("--dtype", default="int4", help="the store whose tokenizer encodes the prompts")
    p.add_argument("--engine", default="llama.cpp", choices=("llama.cpp", "hf"))
    p.add_argument("--hf-dtype", default="bf16", choices=("bf16", "fp32", "fp16"))
    p.add_argument("--serve", action="store_true", help="answer prompts as JSON lines on stdin")
    p.add_argument("--prompts")
    p.add_argument("--json", dest="json_out")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--chat", default="auto")
    p.add_argument("--no-repack", action="store_true")
    a = p.parse_args(argv)
    try:
        tok = TextTokenizer(ensure_store(a.target, a.dtype).tokenizer_info)
        threads = a.threads or os.cpu_count() or 1
        if a.engine == "hf":
            hf = HFBaseline(a.target, a.draft, a.hf_dtype)
            run = lambda prompt, mode, ids, chat, n: hf.run(mode, prompt, ids, chat, n, tok.stop_ids, tok.decode)
        else:
            lcpp = LlamaCppBaseline(a.target, threads, repack=not a.no_repack)
            run = lambda prompt, mode, ids, chat, n: lcpp.run(prompt, ids, chat, n, tok.stop_ids, tok.decode)
    except (CadenceError, OSError, ValueError) as e:
        if a.serve:
            print(json.dumps({"error": f"{a.engine} could not load: {e}"}), flush=True)
            return 1
        print(f"launch: {e}", file=sys.stderr)
        return 1
    if a.serve:
        return _serve(run)
    return _prompt_set(a, tok, run)


def _serve(run) -> int:
    """Rows for prompts, a JSON line each way, until stdin closes."""
    import sys

    from engine.prompts import Prompt

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        q = json.loads(line)
        row = run(Prompt(q["id"], q["kind"], ""), q["mode"], q["ids"], q["chat"], q["max_new"])
        print(json.dumps(row), flush=True)
    return 0


def _prompt_set(a, tok, run) -> int:
    import sys

    from engine.prompts import encode_prompt, load_prompts
    from engine.rows import write_rows

    rows = []
    for prompt in load_prompts(a.prompts):
        ids, chat = encode_prompt(tok, prompt, a.chat)
        rows.append(run(prompt, "llama.cpp", ids, chat, a.max_new_tokens))
        write_rows(a.json_out, rows)  # as each finishes: a crash keeps the rows before it
        print(f"  {prompt.id:<14} llama.cpp {rows[-1]['tokens_per_s']:>7.2f} tok/s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
