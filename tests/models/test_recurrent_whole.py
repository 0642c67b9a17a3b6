"""A forward whose rows are all to be kept (a decode step's, a prompt chunk's: `KVCache.whole`) steps each recurrent
layer's state in place, where a forward that may be rejected writes it into the layer's second buffer (as does a new
cache's first forward: its state's pages, never touched, would each fault twice): the same bits, the state folded at
the commit, and a cache whose forward never committed not used again. A new cache over memory an older one used
starts from zero states."""

import pytest
import torch

from common.settings import SamplingConfig
from formats import loading
from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import WeightStore
from models.kvcache import KVCache
from models.requests import drive
from speculative.verify import Verifier
from tests.models.families import tiny_hf


@pytest.fixture(scope="module", params=["qwen3_5_text", "nemotron_h"])
def model(tmp_path_factory, request):
    d = tmp_path_factory.mktemp(request.param)
    store = WeightStore(convert(HFSource(tiny_hf(request.param, "plain", d / "hf", seed=2)), d / "int4", "int4"))
    return loading.load_store(store).model


def test_a_whole_forward_steps_the_state_in_place_with_the_bits_of_the_second_buffer(model):
    tokens = torch.randint(3, 300, (14,), generator=torch.Generator().manual_seed(11))
    n = len(model.args.rec_layers)
    runs = []
    for whole in (False, True):
        cache, out = model.new_cache(32), []
        for lo, hi in ((0, 8), *((t, t + 1) for t in range(8, 14))):  # a prompt chunk, then decode steps
            cache.whole = whole
            before = [cache.rec_kv(j)[1].data_ptr() for j in range(n)]
            out.append(model.forward(tokens[lo:hi], torch.arange(lo, hi), cache))
            cache.commit()
            if whole:  # folded at the commit, no step back past it; in place but in a new cache's first forward
                assert ([cache.rec_kv(j)[1].data_ptr() for j in range(n)] == before) == (lo > 0)
                assert cache.folded == cache.length == hi and not cache.whole and not cache.chains
                assert not cache.can_rewind(hi - 1)
        cache.reserve(torch.tensor([14]))  # (the second buffer's last state folded in as the next forward would)
        runs.append((out, [cache.rec_kv(j)[1].clone() for j in range(n)]))
    (a, sa), (b, sb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a + sa, b + sb))


def test_a_cache_whose_forward_never_committed_is_not_picked_up_again(model):
    """A step that failed half-way (its states stepped, nothing committed) leaves a cache the next prompt does not
    continue: it prefills afresh, to the tokens of a new verifier."""
    prompt = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(12)).tolist()
    greedy = SamplingConfig()
    first = Verifier(model, greedy)
    nxt = first.start(prompt, 32)
    first.cache.whole = True  # as a step that raised after its forward, before its commit, leaves it
    model.forward(torch.tensor([nxt]), torch.tensor([first.cache.length]), first.cache)
    again = Verifier(model, greedy, previous=first)
    assert again.start(prompt + [nxt], 32) == Verifier(model, greedy).start(prompt + [nxt], 32)
    assert again.reused == 0


def test_a_cache_left_mid_forward_is_neither_kept_by_the_prompt_cache_nor_verified(model):
    """Its states stepped past its text: the prompt cache does not keep it, and a verification's commit on it says so
    in one sentence, where it would keep a rejected branch's state."""
    from common.errors import CadenceError
    from speculative.prefixes import MIN_TOKENS, PrefixCache

    prompt = torch.randint(3, 300, (MIN_TOKENS + 4,), generator=torch.Generator().manual_seed(14)).tolist()
    v = Verifier(model, SamplingConfig())
    nxt = v.start(prompt, MIN_TOKENS + 16)
    v.cache.whole = True  # as a step that raised after its forward, before its commit, leaves it
    model.forward(torch.tensor([nxt]), torch.tensor([v.cache.length]), v.cache)
    prefixes = PrefixCache(64 << 20, None, "tiny")
    prefixes.keep(v.tokens, v.cache)
    assert prefixes.kept == 0
    with pytest.raises(CadenceError, match="left mid-forward"):
        v.cache.commit([0])


def test_a_new_cache_over_memory_an_older_one_used_starts_from_zero_states(model):
    """A batch slot that keeps its range but not its text (its next prompt shares none of it) builds its new cache over
    the old one's bytes, unzeroed: its states start from zeros all the same, as a cache of its own does."""
    storage = torch.zeros(KVCache.numel(model.args, 32, model.kv_dtype))
    g = torch.Generator().manual_seed(13)
    first, second = (torch.randint(3, 300, (9,), generator=g).tolist() for _ in range(2))
    old = Verifier(model, SamplingConfig())
    drive(old.start_steps(first, 32, storage), model.weights)
    old.step(5)  # (its state past the prompt, in the storage's state buffer or the spare)
    storage.normal_(generator=g)  # the old cache's bytes, whatever it left there (its states, its rows)
    again, fresh = Verifier(model, SamplingConfig(), previous=old), Verifier(model, SamplingConfig())
    token = drive(again.start_steps(second, 32, storage), model.weights)  # over the slot's own bytes, not zeroed
    assert token == fresh.start(second, 32)
    assert again.reused == 0

    def ends(c):  # each layer's state after the prompt (folded as the next forward would)
        c.reserve(torch.tensor([c.length]))
        return [c.rec_kv(j)[1] for j in range(len(model.args.rec_layers))]

    assert all(torch.equal(a, b) for a, b in zip(ends(again.cache), ends(fresh.cache)))
