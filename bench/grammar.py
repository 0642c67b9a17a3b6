"""JSON-schema generation side by side in one run (issue 57): cadence's target alone and its tree under the same
grammar (`--modes`, each its own runtime, as users run them), and llama.cpp (llama-cpp-python on the same GGUF, its
grammar sampler given the schema's GBNF, as llama-server's `json_schema` does), greedy, over `SCHEMAS`: tok/s,
the tokens a grammar forced (planted without a model, counted apart) and whether each answer validates.

    python -m bench.grammar [--memory-budget 768MiB --modes std,tree] [--no-llama-cpp] [--max-new-tokens 160]

`SCHEMAS`: what clients hold answers to (nested objects, arrays of objects, enums, bounded numbers, required and
optional fields), each with a request that asks for such an answer; strings are bounded, so that a greedy answer
closes within a test's token limit (tests/speculative/test_grammar_real.py, tests/launch/test_tools.py).
"""

from __future__ import annotations

import json
import sys
import time

SCHEMAS = {
    "nested": (
        "Describe a fictional software engineer as JSON: a name and an address with a city and a country.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 30},
                        "country": {"type": "string", "maxLength": 30},
                    },
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
    ),
    "array": (
        "List two to three groceries to buy as JSON, each with a name and a quantity.",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 20},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        },
                        "required": ["name", "qty"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
    ),
    "enum_bounds": (
        "Triage this bug report as JSON, with the hours a fix takes: 'the login page crashes when the password is empty'.",
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["open", "closed", "pending"]},
                "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                "hours": {"type": "integer", "minimum": 0, "maximum": 40},
            },
            "required": ["status", "priority", "hours"],
            "additionalProperties": False,
        },
    ),
    "optional": (
        "Write a to-do item as JSON for 'renew the passport'.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 40},
                "done": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
    ),
}


def _cadence(mode: str, n: int, budget: str | None) -> dict:
    """Each schema's answer in `mode` (its own runtime): {name: (tok/s, tokens, forced, text)}."""
    import cadence

    out = {}
    with cadence.LLM(mode=mode, memory_budget=budget, max_new_tokens=n, no_trace=True) as llm:
        warm = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        llm.chat([{"role": "user", "content": "Say ok as JSON."}], json_schema=warm)  # its vocabulary made once
        for name, (ask, schema) in SCHEMAS.items():
            t0 = time.perf_counter()
            c = llm.chat([{"role": "user", "content": ask}], json_schema=schema)
            wall = time.perf_counter() - t0
            out[name] = (len(c.token_ids) / wall, len(c.token_ids), c.stats.get("forced", 0), c.text)
    return out


def _llama_cpp(n: int) -> dict:
    """Each schema's answer by llama.cpp under its grammar sampler: {name: (tok/s, tokens, 0, text)}."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from bench.baselines import LlamaCppBaseline
    from engine.prompts import Prompt, encode_prompt
    from formats.convert import ensure_store
    from text.tokenizer import TextTokenizer

    target = "qwen2.5-coder-1.5b"
    tok = TextTokenizer(ensure_store(target, "int4").tokenizer_info)
    lcpp = LlamaCppBaseline(target, 2)
    out = {}
    for name, (ask, schema) in SCHEMAS.items():
        ids, _ = encode_prompt(tok, Prompt(name, "chat", ask, chat=True), "auto")
        gbnf = json_schema_to_gbnf(json.dumps(schema))
        row = lcpp.run(Prompt(name, "chat", ask), ids, True, n, tok.stop_ids, tok.decode, grammar=gbnf)
        new = row["new_token_ids"]
        text = tok.decode([t for t in new if t not in tok.stop_ids])
        out[name] = (len(new) / row["wall_s"], len(new), 0, text)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    import jsonschema

    p = argparse.ArgumentParser(prog="python -m bench.grammar")
    p.add_argument("--modes", default="target,tree")
    p.add_argument("--memory-budget", default=None)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--no-llama-cpp", action="store_true")
    a = p.parse_args(argv)
    runs = {m: _cadence(m, a.max_new_tokens, a.memory_budget) for m in a.modes.split(",")}
    if not a.no_llama_cpp:
        runs["llama.cpp"] = _llama_cpp(a.max_new_tokens)
    base = a.modes.split(",")[0]
    print(f"| schema | {' | '.join(runs)} | {' | '.join(f'/ {base}' for m in runs if m != base)} | forced |")
    print("|---" * (2 * len(runs) + 1) + "|")
    for name, (_, schema) in SCHEMAS.items():
        cells = []
        for m, got in runs.items():
            tps, n, _, text = got[name]
            try:
                jsonschema.validate(json.loads(text), schema)
                ok = ""
            except (ValueError, jsonschema.ValidationError):
                ok = " (invalid)"
            cells.append(f"{tps:.2f} ({n} tok){ok}")
        ratios = [f"{runs[m][name][0] / runs[base][name][0]:.2f}x" for m in runs if m != base]
        forced = "/".join(str(runs[m][name][2]) for m in runs if m != "llama.cpp")
        print(f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} | {forced} |")
    totals = {m: sum(g[k][1] for k in g) / sum(g[k][1] / g[k][0] for k in g) for m, g in runs.items()}
    print("all: " + ", ".join(f"{m} {v:.2f} tok/s" for m, v in totals.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
