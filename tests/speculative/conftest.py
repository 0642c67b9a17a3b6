"""Fixtures the speculation tests share."""

from __future__ import annotations

import pytest

from formats import loading
from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import WeightStore
from tests.models.families import tiny_hf


@pytest.fixture(scope="session")
def int4_pair(tmp_path_factory):
    """A tiny Qwen 2 target and another as its draft (seeds 1 and 2), in int4, loaded in this process."""
    tmp = tmp_path_factory.mktemp("int4-pair")
    out = []
    for name, seed in (("target", 1), ("draft", 2)):
        hf = tiny_hf("qwen2", "plain", tmp / f"hf-{name}", seed=seed)
        out.append(loading.load_store(WeightStore(convert(HFSource(hf), tmp / f"int4-{name}", "int4"))).model)
    return out
