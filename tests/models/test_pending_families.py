"""The architectures of 2026 cadence does not run yet (models/families/pending.py): every HF `model_type` of the
22 now runs, so what is left is GGUF readers (and Nemotron-3's experts). A GGUF of each architecture the table names,
written with llama.cpp's own `gguf` writer, is refused in one sentence naming what it needs, never a bare "not
supported" or a traceback; and the table holds none that cadence runs."""

import numpy as np
import pytest

from common.errors import CadenceError
from models.families import BY_GGUF, BY_HF
from models.families.pending import GGUF_NEEDS, HF_NEEDS
from formats.source import GGUFSource


def test_the_table_names_no_architecture_cadence_runs():
    assert not set(HF_NEEDS) & set(BY_HF)
    assert not set(GGUF_NEEDS) & set(BY_GGUF)


def test_every_hf_model_type_of_the_year_runs():
    assert not HF_NEEDS


@pytest.mark.parametrize("arch", sorted(GGUF_NEEDS))
def test_a_gguf_of_a_pending_architecture_is_refused_naming_what_it_needs(tmp_path, arch):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CadenceError) as e:
        GGUFSource(path)
    msg = str(e.value)
    assert f"architecture '{arch}' is not supported yet: it needs {GGUF_NEEDS[arch]}" in msg, msg
    assert "\n" not in msg
