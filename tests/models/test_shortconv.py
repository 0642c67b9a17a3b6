"""Short-convolution layers (LFM2) under a token tree: a node's taps are its own ancestors' rows, never a sibling's
or the preceding row of the flattened tree; a tree forward gives each node what decoding its path alone gives, bit
for bit; and a rejected branch leaves the state (the rows `commit(keep)` keeps) exactly the accepted path's."""

import pytest
import torch

from models import loading
from models.attention import Visibility
from models.convert import convert
from models.shortconv import taps
from models.source_hf import HFSource
from models.store import WeightStore
from tests.models.families import tiny_hf

# a tree under a committed context of 5: 0 -> {1 -> {3, 4}, 2 -> 5}
PARENTS = [-1, 0, 0, 1, 1, 2]


def test_taps_are_the_nearest_ancestors_then_the_committed_rows():
    got = taps(Visibility.tree(5, PARENTS), 3).tolist()
    # slots: the tree's nodes at 5..10; committed 0..4
    assert got == [[5, 4, 3], [6, 5, 4], [7, 5, 4], [8, 6, 5], [9, 6, 5], [10, 7, 5]]
    assert taps(Visibility.causal(0, 2), 3).tolist() == [[0, -1, -1], [1, 0, -1]]  # zeros before the context


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    d = tmp_path_factory.mktemp("lfm2")
    store = WeightStore(convert(HFSource(tiny_hf("lfm2", "plain", d / "hf", seed=1)), d / "int4", "int4"))
    return loading.load_store(store).model


def _path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


def test_a_tree_gives_each_node_its_path_decoded_alone_and_keeps_the_accepted_state(lfm2):
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 300, (9,), generator=g)
    nodes = torch.randint(3, 300, (len(PARENTS),), generator=g)
    depth = [len(_path(n)) for n in range(len(PARENTS))]

    def primed():
        cache = lfm2.new_cache(32)
        lfm2.forward(prompt, torch.arange(len(prompt)), cache)
        cache.commit()
        return cache

    cache = primed()
    L = cache.length
    pos = torch.tensor([L - 1 + d for d in depth])
    tree = lfm2.forward(nodes, pos, cache, Visibility.tree(L, PARENTS))
    for n in range(len(PARENTS)):  # the chain of n's path, decoded one token at a time from the same prompt
        alone = primed()
        for k, m in enumerate(_path(n)):
            logits = lfm2.forward(nodes[m : m + 1], torch.tensor([L + k]), alone)[0]
            alone.commit()
        assert torch.equal(tree[n], logits), n
    accepted = _path(4)  # 0 -> 1 -> 4: siblings 2, 3, 5 rejected
    cache.commit(accepted)
    nxt = torch.tensor([7])
    after = lfm2.forward(nxt, torch.tensor([L + len(accepted)]), cache)[0]
    alone = primed()
    lfm2.forward(nodes[accepted], torch.arange(L, L + len(accepted)), alone)
    alone.commit()
    assert torch.equal(after, lfm2.forward(nxt, torch.tensor([L + len(accepted)]), alone)[0])
    for i in lfm2.args.conv_layers:  # the accepted path's rows, bit for bit
        assert torch.equal(cache.kv(i)[0][: cache.length + 1], alone.kv(i)[0][: alone.length + 1])
