"""The prompt cache that outlives its slot (speculative/prefixes.py, issue 57 item 3): four conversations interleaved
over two slots each prefill only their own new tokens on every next turn, from memory or from disk (and from a later
run's disk), and every answer is the one a run with no cache gives; a cache restored is the kept one to the bit, for
every kind of layer (sliding windows, recurrent states)."""

from __future__ import annotations

import pytest
import torch

from common.settings import SamplingConfig, TreeConfig
from formats import loading
from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import WeightStore
from speculative.batch import Lockstep, run_all
from speculative.drafter import LocalDraft
from speculative.loop import Speculation
from models import kernel_build
from speculative.prefixes import MIN_TOKENS, PrefixCache, prompt_cache
from speculative.slots import LocalBatch
from speculative.verify import LocalTarget
from tests.models.families import tiny_hf

CONTEXT = 200
NEW = 8


def _loop(target, draft, prefixes=None):
    cfg = TreeConfig(mode="tree", width=6, adaptive=False)
    return Speculation(LocalTarget(target, prefixes), LocalDraft(draft), "tree", cfg, SamplingConfig(), CONTEXT)


def _conversations(n: int = 4) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    system = torch.randint(3, 300, (40,), generator=g).tolist()  # a system prompt all four share
    return {f"c{i}": system + torch.randint(3, 300, (5 + 3 * i,), generator=g).tolist() for i in range(n)}


def _talk(target, draft, prefixes, turns: int = 3):
    """Four conversations, each turn of each in turn, over two slots: (each turn's answer and the prompt tokens it
    found cached), by (conversation, turn)."""
    loop = _loop(target, draft)
    kv = lambda rows: target.args.kv_bytes(rows) // 4  # noqa: E731
    batch = Lockstep(loop, LocalBatch(target, prefixes), lambda slot: LocalDraft(draft), 2, LocalDraft.propose_many, kv)
    texts, out = _conversations(), {}
    for turn in range(turns):
        for name in sorted(texts):
            job = ((name, turn), dict(prompt_ids=texts[name], max_new=NEW, stop=set()))
            [g] = [o.result for _, o in run_all(batch, iter([job])) if o.result is not None]
            out[name, turn] = (list(texts[name]), g.new_ids, g.stats["reused_prompt_tokens"])
            texts[name] = texts[name] + g.new_ids + [7, 8, 9, 10, 11]  # the next turn: the answer and new words
    return out


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_four_conversations_over_two_slots_prefill_only_their_new_tokens(int4_pair, tier, tmp_path):
    target, draft = int4_pair
    fresh = _loop(target, draft)
    none = _talk(target, draft, None)
    ram, folder = (64 << 20, None) if tier == "memory" else (0, tmp_path / "pc")
    prefixes = PrefixCache(ram, folder, "tiny")
    cached = _talk(target, draft, prefixes)
    for key, (prompt, answer, reused) in cached.items():
        assert answer == fresh.generate(prompt, NEW, set(), reuse=False).new_ids, key
        assert answer == none[key][1], key
        if key[1]:  # a next turn: all but its new words (and the prompt's last token, which runs again) were cached
            assert reused == len(prompt) - 1 - 5, key
        assert none[key][2] <= reused, key
    # without the cache, two of the four conversations lose their slot to the others every turn
    assert sum(r for k, (_, _, r) in none.items() if k[1]) < sum(r for k, (_, _, r) in cached.items() if k[1])
    assert prefixes.kept >= 4 and prefixes.reused > 0
    if tier == "disk":  # a later run of the same model finds them on disk: a first turn's prompt is the system's
        again = PrefixCache(0, folder, "tiny")
        assert len(again.disk) == len(prefixes.disk) > 0
        prompt = _conversations()["c0"]
        t = LocalTarget(target, again)
        first, reused = t.start(prompt, CONTEXT, SamplingConfig())
        assert reused >= 40  # at least the system prompt
        assert first == LocalTarget(target).start(prompt, CONTEXT, SamplingConfig())[0]


def test_rows_on_disk_are_found_only_by_the_math_that_wrote_them(int4_pair, tmp_path, monkeypatch):
    """Entries on disk are keyed by the kernel path and the math (models/ and its C++) that computed them, beside the
    store and the --kv-dtype: a later run of the same cadence finds them, one whose math changed finds none (and
    computes the rows afresh rather than read another math's)."""
    target, _ = int4_pair
    store, config = tmp_path / "store", {"dir": str(tmp_path / "pc")}
    store.mkdir()
    prompt = _conversations()["c0"]
    t = LocalTarget(target, prompt_cache(config, str(store)))
    t.start(prompt, CONTEXT, SamplingConfig())
    t.start(list(range(100, 140)), CONTEXT, SamplingConfig())  # another text: the first one's rows are kept
    later = prompt_cache(config, str(store))
    assert len(later.disk) == 1
    assert LocalTarget(target, later).start(prompt, CONTEXT, SamplingConfig())[1] == len(prompt) - 1
    monkeypatch.setattr(kernel_build, "numerics_digest", lambda: "0" * 64)
    changed = prompt_cache(config, str(store))
    assert not changed.disk
    assert LocalTarget(target, changed).start(prompt, CONTEXT, SamplingConfig())[1] == 0


def test_a_short_text_is_not_kept_and_the_bound_holds(int4_pair):
    target, _ = int4_pair
    for prefixes, length in ((PrefixCache(64 << 20, None, "tiny"), MIN_TOKENS - 2), (PrefixCache(1, None, "tiny"), 60)):
        t = LocalTarget(target, prefixes)
        t.start(list(range(3, 3 + length)), 100, SamplingConfig())
        t.start(list(range(100, 140)), 100, SamplingConfig())  # the first text is not continued
        assert not prefixes.ram and prefixes.kept == 0


@pytest.mark.parametrize(
    "mt,v", [("gemma3_text", "plain"), ("qwen3_5_text", "plain"), ("lfm2", "plain"), ("falcon_h1", "plain")]
)
def test_a_restored_cache_is_the_kept_one_for_every_kind_of_layer(mt, v, tmp_path):
    """Sliding windows (rows past the window dropped), delta-nets' and Mamba's states (a prompt chunk's kept whole),
    convolutions' taps: a conversation whose cache another took is restored, and its next turn decodes the tokens a
    run with no cache does."""
    model = loading.load_store(WeightStore(convert(HFSource(tiny_hf(mt, v, tmp_path / "hf")), tmp_path / "s", "fp32")))
    model = model.model
    cfg = TreeConfig(mode="tree", width=6, adaptive=False)
    prefixes = PrefixCache(64 << 20, None, mt)
    loop = Speculation(LocalTarget(model, prefixes), LocalDraft(model), "tree", cfg, SamplingConfig(), 200)
    fresh = Speculation(LocalTarget(model), LocalDraft(model), "tree", cfg, SamplingConfig(), 200)
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(3, 300, (n,), generator=g).tolist() for n in (70, 50))
    first = loop.generate(a, NEW, set())
    loop.generate(b, NEW, set())  # another conversation takes the cache: a's goes to the prompt cache
    nxt = a + first.new_ids + [7, 8, 9]
    again = loop.generate(nxt, NEW, set())
    assert again.stats["reused_prompt_tokens"] >= len(a), mt
    assert again.new_ids == fresh.generate(nxt, NEW, set(), reuse=False).new_ids, mt


def test_a_new_prompt_s_cache_is_made_once_the_last_one_is_freed(int4_pair, monkeypatch):
    """The plan counts one KV cache a slot: a prompt that does not continue the last one's text gets its cache only
    once nothing holds the last one (else both are held at once, 112 MiB over the plan for the 1.5B at 2048 tokens,
    and a cgroup at the budget kills the verifier on the second prompt). The draft's caches alike."""
    import weakref

    target, draft = int4_pair
    made = []
    for model in (target, draft):
        real = model.new_cache

        def new_cache(capacity, storage=None, real=real, model=model):
            alive = [r for m, r in made if m is model and r() is not None]
            assert not alive, "a new KV cache was made while the last one was still held"
            cache = real(capacity, storage)
            made.append((model, weakref.ref(cache)))
            return cache

        monkeypatch.setattr(model, "new_cache", new_cache)
    loop = _loop(target, draft)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):  # unrelated prompts: nothing of the last one is kept
        loop.generate(torch.randint(3, 300, (20,), generator=g).tolist(), NEW, set())
    assert len(made) >= 6
