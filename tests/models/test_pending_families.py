"""The architectures of 2026 cadence does not run yet (models/families/pending.py): a model of each, its config.json
as transformers 5 saves it, is refused in one sentence that names what it needs, never a bare "not supported" or a
traceback; and the table holds none that cadence runs."""

import pytest
import torch

from common.errors import CadenceError
from models.families import BY_GGUF, BY_HF
from models.families.pending import GGUF_NEEDS, HF_NEEDS
from models.source_hf import HFSource
from tests.models.families import write_tokenizer

TYPES = sorted(HF_NEEDS)


def test_the_table_names_no_architecture_cadence_runs():
    assert not set(HF_NEEDS) & set(BY_HF)
    assert not set(GGUF_NEEDS) & set(BY_GGUF)


@pytest.mark.parametrize("mt", TYPES)
def test_a_model_of_a_pending_family_is_refused_naming_what_it_needs(tmp_path, mt):
    from safetensors.torch import save_file
    from transformers import AutoConfig

    AutoConfig.for_model(mt).save_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, tmp_path / "model.safetensors")
    write_tokenizer(tmp_path)
    with pytest.raises(CadenceError) as e:
        HFSource(tmp_path)
    msg = str(e.value)
    # a multimodal wrapper (gemma4, qwen3_5_moe) is named by its text model's type
    assert f" is not supported yet: it needs {HF_NEEDS[mt]}" in msg and f"model_type '{mt}" in msg
    assert "\n" not in msg
