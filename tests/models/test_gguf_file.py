"""The GGUF header reader on damaged files: any garbled header byte ends in a CadenceError sentence."""

import random

import pytest

from common.errors import CadenceError
from formats.source import GGUFSource
from formats.weights import random_tensors
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    args = TINY["qwen"]
    return write_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", args, random_tensors(args, seed=5))


def test_garbled_headers_end_in_a_sentence(tiny_gguf, tmp_path):
    """Random bytes over the header (fields, vocabulary, tensor table); before, lengths of about 2**63
    raised OverflowError and a garbled vocabulary a bare tokenizers Exception."""
    src = tiny_gguf.read_bytes()
    bad, refused = tmp_path / "bad.gguf", 0
    for seed in range(200):
        rng = random.Random(seed)
        data = bytearray(src)
        for _ in range(rng.choice([1, 2, 5])):
            at, n = rng.randrange(8, 9000), rng.choice([1, 2, 4, 8])
            data[at : at + n] = rng.randbytes(n)
        bad.write_bytes(bytes(data))
        try:
            GGUFSource(bad)
        except CadenceError as e:
            refused += 1
            assert "\n" not in str(e) and "bad.gguf" in str(e), (seed, str(e))
    assert refused > 100  # most garbles are caught at the header, not later


@pytest.mark.parametrize("size", [0, 10])
def test_short_file(tmp_path, size):
    f = tmp_path / "short.gguf"
    f.write_bytes(b"GGUF"[:size] + bytes(max(0, size - 4)))
    with pytest.raises(CadenceError, match="too short to be a GGUF model"):
        GGUFSource(f)
