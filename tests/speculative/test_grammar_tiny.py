"""Grammars (speculative/grammar.py) on tiny random models with a real byte-level vocabulary in a weight store: what a
grammar is read from (a JSON schema, Lark, GBNF, a file) and the sentence a bad one gets; the tokens a constraint
allows after a text; and speculation under a grammar, greedy and sampled: tree (best first and paced), chain, the
trie alone and a batch write the target's own tokens, every one allowed; the trie's forbidden candidates never
reach a verification, and a run of tokens the grammar allows alone is planted without a draft step of its own."""

from __future__ import annotations

import math
from dataclasses import replace

import llguidance
import pytest
import torch

from common.errors import CadenceError
from common.settings import SamplingConfig, TreeConfig
from formats.convert import convert
from speculative.grammar import Constraint, grammar_of, source_of, vocabulary
from formats.source_hf import HFSource
from formats.store import WeightStore
from models.transformer import Transformer
from formats.weights import ResidentWeights, random_tensors
from speculative.batch import Lockstep, run_all
from speculative.drafter import LocalDraft
from speculative.lookup import TrieDraft
from speculative.loop import Speculation
from speculative.trie import TokenTrie, grammar_keep
from speculative.slots import LocalBatch
from speculative.verify import LocalTarget
from tests.conftest import TINY
from tests.models.tiny_files import write_hf_dir

ARGS = TINY["qwen"]
# a record a random model cannot run away in: a forced opening, a bounded number, a choice, a bounded name
RECORD = r"""
start: "{\"id\": " NUM ", \"ok\": " BOOL ", \"tag\": \"" NAME "\"}"
NUM: /[1-9][0-9]{0,3}/
BOOL: "true" | "false"
NAME: /[a-z]{1,6}/
"""
PROMPT = [40, 41, 12, 98, 77, 40, 41, 12]


def _store(root, seed, noise=None):
    t = random_tensors(ARGS, seed, scale=2.0)
    if noise is not None:  # a draft that resembles the target
        extra = random_tensors(ARGS, noise, scale=2.0)
        t = {k: v + 0.15 * extra[k] for k, v in t.items()}
    return WeightStore(convert(HFSource(write_hf_dir(root / "hf", ARGS, t)), root / "store", "fp32"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    stores = _store(root / "t", 1), _store(root / "d", 1, noise=2)
    return tuple(Transformer(s.args, ResidentWeights(s)) for s in stores)


def _valid(pair, new: list[int], grammar: str) -> bool:
    """Whether the output is a whole text the grammar allows, then its end."""
    vocab = vocabulary(source_of(pair[0]), ARGS.vocab_size)
    m = llguidance.LLMatcher(vocab, grammar)
    text = new[:-1] if new and new[-1] in vocab.eos_tokens else new
    return m.try_consume_tokens(text) == len(text) and m.is_accepting() and len(text) < len(new)


def test_a_grammar_is_read_from_a_schema_lark_gbnf_or_a_file(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    made = grammar_of(schema)
    assert grammar_of(made) == made and grammar_of('{"type": "object", "properties": {"n": {"type": "integer"}}}')
    (tmp_path / "s.json").write_text('{"type": "array"}')
    (tmp_path / "g.lark").write_text('start: "yes" | "no"')
    (tmp_path / "g.gbnf").write_text('root ::= "yes" | "no"')
    for name in ("s.json", "g.lark", "g.gbnf"):
        assert "grammars" in grammar_of(str(tmp_path / name)) or "start" in grammar_of(str(tmp_path / name))
    assert grammar_of("") == "" and grammar_of(None) == ""
    with pytest.raises(CadenceError, match="^the grammar does not compile: properties must be an object$"):
        grammar_of({"type": "object", "properties": 3})
    with pytest.raises(CadenceError, match=r"^the grammar does not compile: at 1\(8\): unknown name: \"foo\"$"):
        grammar_of("start: foo")
    with pytest.raises(CadenceError, match="reads as JSON but does not parse"):
        grammar_of('{"type": ')
    # a server's client names no file of the server's: the path is read as a (bad) grammar, not opened
    with pytest.raises(CadenceError, match="does not compile"):
        grammar_of(str(tmp_path / "g.lark"), files=False)


def test_a_constraint_allows_what_the_grammar_allows_after_any_text(pair):
    target, _ = pair
    c = Constraint.of(SamplingConfig(grammar=grammar_of(RECORD)), source_of(target), ARGS.vocab_size, len(PROMPT))
    vocab = vocabulary(source_of(target), ARGS.vocab_size)
    opening = vocab.tokenize_str('{"id": ')
    assert c.forced(PROMPT) == opening  # the literal opening, token for token, forced
    after = c.allowed(PROMPT + opening)
    digits = {vocab.tokenize_str(str(d))[0] for d in range(1, 10)}
    assert set(torch.nonzero(after).flatten().tolist()) == digits  # a number's first digit, never 0
    assert c.allowed(PROMPT + opening + vocab.tokenize_str("0")) is None  # a text the grammar refuses
    # rows in any order: each is matched from where the last one left the matcher
    assert torch.equal(c.allowed(PROMPT + opening), after) and not c.allowed(PROMPT).equal(after)
    two = vocab.tokenize_str("12")
    assert c.keeps(PROMPT + opening, [two, vocab.tokenize_str("x"), two + vocab.tokenize_str(", ")]) == [
        True,
        False,
        True,
    ]
    with pytest.raises(CadenceError, match="needs the model's tokenizer"):
        Constraint.of(SamplingConfig(grammar=grammar_of(RECORD)), None, ARGS.vocab_size, 0)


def test_a_model_with_more_rows_than_its_tokenizer_has_tokens_gets_a_mask_of_every_row(pair):
    """An HF Qwen has 151,936 output rows and 151,665 tokens: the view is padded to the rows with tokens of no bytes,
    which no grammar allows, so a mask covers every row of the logits it is applied to."""
    target, _ = pair
    rows = ARGS.vocab_size + 100
    c = Constraint.of(SamplingConfig(grammar=grammar_of(RECORD)), source_of(target), rows, len(PROMPT))
    mask = c.allowed(PROMPT + c.forced(PROMPT))
    assert mask.shape == (rows,) and mask.any() and not mask[ARGS.vocab_size :].any()


def test_the_trie_passes_over_the_candidates_a_grammar_forbids(pair):
    target, _ = pair
    c = Constraint.of(SamplingConfig(grammar=grammar_of(RECORD)), source_of(target), ARGS.vocab_size, 0)
    vocab = vocabulary(source_of(target), ARGS.vocab_size)
    text = vocab.tokenize_str('{"id": 7')
    trie = TokenTrie()
    trie.insert(text + vocab.tokenize_str("x1") + text + vocab.tokenize_str("5, "))  # after '7': 'x' or '5'
    free = trie.retrieve(text, 8)
    held = trie.retrieve(text, 8, keep=grammar_keep(c, text))
    assert vocab.tokenize_str("x")[0] in free.tokens and vocab.tokenize_str("x")[0] not in held.tokens
    assert held.tokens[:1] == vocab.tokenize_str("5") and all(c.keeps(text, [[t] for t in held.tokens[:1]]))


def _stops(pair) -> set[int]:
    return set(vocabulary(source_of(pair[0]), ARGS.vocab_size).eos_tokens)


def _loop(pair, mode, sampling, trie=False, width=6, growth="best", draft=True):
    target, d = pair
    tree = TreeConfig(mode=mode, width=width, chain_k=3, trie=trie, adaptive=False, growth=growth)
    side = LocalDraft(d) if draft else TrieDraft(width, (source_of(target), ARGS.vocab_size))
    return Speculation(LocalTarget(target), side, mode if mode != "target" else "tree", tree, sampling, 96)


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(), SamplingConfig(temperature=1.0, top_k=20, seed=3)], ids=["greedy", "sampled"]
)
def test_speculation_under_a_grammar_is_the_target_alone(pair, sampling):
    """Tree (best first and paced, with the trie), chain and the trie alone: the target's own tokens under the
    grammar, every one allowed; the opening the grammar forces is planted, certain, and accepted."""
    grammar = grammar_of(RECORD)
    cfg = replace(sampling, grammar=grammar)
    alone = _loop(pair, "tree", cfg).generate(PROMPT, 64, _stops(pair), mode="target")
    assert _valid(pair, alone.new_ids, grammar) and len(alone.new_ids) > 10
    free = _loop(pair, "tree", sampling).generate(PROMPT, 64, _stops(pair), mode="target").new_ids
    assert not _valid(pair, free, grammar)  # the grammar is what holds the text: a test of it, not of nothing
    runs = {
        "best": _loop(pair, "tree", cfg, trie=True),
        "pacer": _loop(pair, "tree", cfg, trie=True, growth="pacer"),
        "chain": _loop(pair, "chain", cfg),
        "trie": _loop(pair, "tree", cfg, draft=False),
    }
    for name, loop in runs.items():
        got = loop.generate(PROMPT, 64, _stops(pair))
        assert got.new_ids == alone.new_ids, name
        if name != "chain":  # the opening '{"id": ' is planted whole (the chain's budget is three)
            assert got.stats.get("forced", 0) >= 5, (name, got.stats)


def test_a_batch_under_grammars_is_each_generation_alone(pair):
    """Three generations in one batch, one free, two under different grammars, one of them sampled."""
    target, draft = pair
    loop = _loop(pair, "tree", SamplingConfig())
    yes_no = grammar_of('start: ("yes" | "no") " " /[a-z]{2,5}/ "."')
    settings = [
        SamplingConfig(grammar=grammar_of(RECORD)),
        SamplingConfig(),
        SamplingConfig(temperature=0.9, seed=4, grammar=yes_no),
    ]
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    alone = [loop.generate(p, 48, _stops(pair), mode="target", sampling=c).new_ids for p, c in zip(prompts, settings)]
    batch = Lockstep(loop, LocalBatch(target), lambda slot: LocalDraft(draft), 3, LocalDraft.propose_many)
    for i, (p, c) in enumerate(zip(prompts, settings)):
        batch.join(i, p, 48, _stops(pair), sampling=c)
    got = {k: o.result.new_ids for k, o in run_all(batch, iter(())) if o.result is not None}
    assert got == dict(enumerate(alone))
    assert _valid(pair, alone[0], settings[0].grammar) and _valid(pair, alone[2], yes_no)


def test_a_draft_whose_head_holds_no_token_the_grammar_allows_proposes_none(tmp_path):
    """A draft with a cut head (FR-Spec: the frequent tokens' rows only) where the grammar allows none of them: its
    distribution there is empty, not a softmax over nothing (NaN), so no forbidden token is planted and every draft
    budget keeps a finite price; the governor, which had priced every budget at NaN and so played the plain step
    (a 768 MiB server at a fifth of its speed after one JSON answer), plays the draft where it earns most."""
    from formats import loading

    grammar = grammar_of(RECORD)
    target = _store(tmp_path / "t", 1)
    lean = loading.load_store(_store(tmp_path / "d", 1, noise=2), head_rows=1, tokenizer=False).model  # "!" only
    model = Transformer(target.args, ResidentWeights(target))
    vocab = vocabulary(source_of(model), ARGS.vocab_size)
    assert not any(t < 1 for s in ('{"id": ', "1", "true", "a") for t in vocab.tokenize_str(s))
    tree = TreeConfig(mode="tree", width=6, trie=False, adaptive=True, growth="best")
    loop = Speculation(LocalTarget(model), LocalDraft(lean), "tree", tree, SamplingConfig(grammar=grammar), 96)
    alone = loop.generate(PROMPT, 40, _stops((model,)), mode="target").new_ids
    got = loop.generate(PROMPT, 40, _stops((model,)))
    assert got.new_ids == alone and got.stats["drafted"] == got.stats.get("forced", 0) > 0, got.stats
    for governor in loop.governors.values():
        assert all(math.isfinite(governor.estimate(a) or 0.0) for a in governor.arms)
