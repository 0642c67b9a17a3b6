"""The model families cadence runs, one short module each over the shared pieces of `base`."""

from __future__ import annotations

from models.families.base import Family
from models.families.exaone import EXAONE4
from models.families.falcon_h1 import FALCON_H1
from models.families.gemma import GEMMA2, GEMMA3
from models.families.gemma4 import GEMMA4
from models.families.glm import GLM4
from models.families.glm_moe import GLM4_MOE
from models.families.gpt_oss import GPT_OSS
from models.families.granite_hybrid import GRANITE_HYBRID
from models.families.lfm2 import LFM2, LFM2_MOE
from models.families.nemotron_h import NEMOTRON_H
from models.families.llama4 import LLAMA4
from models.families.mistral4 import MISTRAL4
from models.families.llama import GRANITE, LLAMA, MINISTRAL3, MISTRAL, MIXTRAL, SEED_OSS
from models.families.olmo import OLMO2, OLMO3, OLMO_HYBRID, OLMOE
from models.families.phi3 import PHI3
from models.families.qwen import QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE
from models.families.qwen35 import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from models.families.smollm3 import SMOLLM3

FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    GRANITE,
    QWEN2,
    QWEN3,
    GEMMA2,
    GEMMA3,
    PHI3,
    OLMO2,
    QWEN2_MOE,
    QWEN3_MOE,
    OLMOE,
    MIXTRAL,
    SMOLLM3,
    OLMO3,
    SEED_OSS,
    EXAONE4,
    GLM4,
    MINISTRAL3,
    LFM2,
    QWEN3_5,
    GRANITE_HYBRID,
    NEMOTRON_H,
    GPT_OSS,
    QWEN3_5_MOE,
    LFM2_MOE,
    GLM4_MOE,
    QWEN3_NEXT,
    OLMO_HYBRID,
    LLAMA4,
    FALCON_H1,
    MISTRAL4,
    GEMMA4,
)
BY_HF = {t: f for f in FAMILIES for t in f.hf_types}
BY_GGUF = {a: f for f in FAMILIES for a in f.gguf_archs}
BY_NAME = {f.name: f for f in FAMILIES}
