"""A recurrent model's cache built over memory an older cache used (a batch slot's own range, kept for its next prompt
that shares none of its text): its states start from zeros, as a cache of its own does."""

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


def test_a_new_cache_over_memory_an_older_one_used_starts_from_zero_states(model):
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
