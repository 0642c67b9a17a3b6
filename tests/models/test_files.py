"""Issue 24: files that are not what they claim (a device given as a model, a config.json that is not JSON,
a damaged tokenizer, safetensors header or weight store, a full disk) end in one sentence naming the file."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import paths
from common.errors import CadenceError
from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import FORMAT_VERSION, WeightStore
from text.tokenizer import TextTokenizer
from formats.weights import random_tensors
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf, write_hf_dir

ARGS = TINY["qwen"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    t = random_tensors(ARGS, seed=5)
    hf = write_hf_dir(d / "hf", ARGS, t)
    return hf, write_gguf(d / "tiny.gguf", ARGS, t), convert(HFSource(hf), d / "store", "fp32")


def launch_run(target, home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CADENCE_HOME=str(home), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    argv = [
        "run",
        "--mode",
        "target",
        "--target",
        str(target),
        "--prompt",
        "x",
        "--max-new-tokens",
        "2",
        "--no-monitor",
    ]
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *argv], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def one_sentence(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 1 and "Traceback" not in p.stderr and lines[-1].startswith("launch: "), p.stderr
    assert sum(ln.startswith("launch: ") for ln in lines) == 1, p.stderr
    return lines[-1].removeprefix("launch: ")


def damaged(src: Path, tmp_path: Path, name: str, data: bytes | None) -> Path:
    """A copy of the folder `src` with `name` holding `data` (None: made a folder)."""
    d = shutil.copytree(src, tmp_path / src.name)
    (d / name).unlink()
    if data is None:
        (d / name).mkdir()
    else:
        (d / name).write_bytes(data)
    return d


def test_a_config_json_that_is_not_utf8_given_as_target(made, tmp_path):
    """It was `UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff`."""
    d = damaged(made[0], tmp_path, "config.json", b"\xff\xfe{")
    line = one_sentence(launch_run(d, tmp_path / "home"))
    assert line == f"{d / 'config.json'} is not UTF-8 text (byte 0 is 0xff); re-download it"


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo"])
def test_a_device_or_a_pipe_given_as_target_says_what_it_is(tmp_path, kind):
    """They were said not to exist; reading one would never end."""
    target = Path(kind)
    if kind == "fifo":
        target = tmp_path / "model.gguf"
        os.mkfifo(target)
    what = "a character device" if kind == "/dev/zero" else "a named pipe (FIFO)"
    line = one_sentence(launch_run(target, tmp_path / "home"))
    assert line == f"{target} is {what}, not a file; give a .gguf file or an HF model directory"


CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 300,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 96,
}


@pytest.mark.parametrize(
    "name,data,says",
    [
        (
            "config.json",
            b"{nope",
            (
                "config.json is not valid JSON (Expecting property name enclosed in double quotes, "
                "line 1 column 2); re-download it"
            ),
        ),
        ("config.json", b"[1, 2]", "config.json holds a JSON list, not an object; re-download it"),
        ("config.json", None, "config.json is a folder, not a file; re-download it"),
        (
            "config.json",
            json.dumps({**CONFIG, "hidden_size": None}).encode(),
            "config.json has a field of the wrong kind for a qwen2 config (int() argument must be",
        ),
        (
            "config.json",
            json.dumps({**CONFIG, "hidden_size": "big"}).encode(),
            "config.json has a field of the wrong kind",
        ),
        (
            "config.json",
            json.dumps({k: v for k, v in CONFIG.items() if k != "vocab_size"}).encode(),
            "config.json has no 'vocab_size' field, which a qwen2 config needs; re-download it",
        ),
        (
            "tokenizer.json",
            b"{nope",
            (
                "tokenizer.json is not a tokenizer the tokenizers library reads (key must be a "
                "string at line 1 column 2); re-download it"
            ),
        ),
        ("tokenizer.json", b'{"model": 3}', "tokenizer.json is not a tokenizer the tokenizers library reads"),
        ("tokenizer.json", b"\xff", "tokenizer.json is not UTF-8 text (byte 0 is 0xff); re-download it"),
        ("tokenizer_config.json", b"{nope", "tokenizer_config.json is not valid JSON"),
        ("tokenizer_config.json", b"[1]", "tokenizer_config.json holds a JSON list, not an object"),
        (
            "model.safetensors",
            b"\xff" * 8 + b"{}",
            "model.safetensors is a damaged safetensors file (Error while deserializing header",
        ),
    ],
    ids=[
        "config-not-json",
        "config-a-list",
        "config-a-folder",
        "config-null-field",
        "config-text-field",
        "config-no-field",
        "tokenizer-not-json",
        "tokenizer-not-a-tokenizer",
        "tokenizer-not-utf8",
        "tokenizer-config-not-json",
        "tokenizer-config-a-list",
        "safetensors-header",
    ],
)
def test_damaged_files_of_an_hf_directory(made, tmp_path, name, data, says):
    d = damaged(made[0], tmp_path, name, data)
    with pytest.raises(CadenceError) as e:
        HFSource(d)
    assert str(e.value).startswith(f"{d}/{says}"), str(e.value)


def test_a_tokenizer_json_that_is_a_device(made, tmp_path):
    d = shutil.copytree(made[0], tmp_path / "hf")
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to("/dev/zero")
    with pytest.raises(CadenceError, match=f"^{d}/tokenizer.json is a character device, not a file; re-download it$"):
        HFSource(d)


@pytest.mark.parametrize(
    "name,data,says",
    [
        ("manifest.json", b"\xff\xfe", "manifest.json is not UTF-8 text (byte 0 is 0xff)"),
        ("manifest.json", b"[]", "manifest.json holds a JSON list, not an object"),
        (
            "manifest.json",
            b'{"format_version": %d}' % FORMAT_VERSION,
            "manifest.json is damaged (it has no 'model' entry)",
        ),
        ("weights.bin", None, "weights.bin is a folder, not a file"),
        ("tokenizer.json", b"\xff", "tokenizer.json is not UTF-8 text (byte 0 is 0xff)"),
        ("tokenizer.json", b"{nope", "tokenizer.json is not a tokenizer the tokenizers library reads (key must be"),
    ],
    ids=[
        "manifest-not-utf8",
        "manifest-a-list",
        "manifest-no-model",
        "weights-a-folder",
        "tokenizer-not-utf8",
        "tokenizer-not-json",
    ],
)
def test_damaged_files_of_a_weight_store(made, tmp_path, name, data, says):
    d = damaged(made[2], tmp_path, name, data)
    with pytest.raises(CadenceError) as e:
        TextTokenizer(WeightStore(d).tokenizer_info)
    assert str(e.value).startswith(f"{d}/{says}"), str(e.value)
    assert str(e.value).endswith(f"; delete {d} and convert again")


def test_a_full_disk_during_conversion_names_the_store_and_what_to_do(made, tmp_path):
    """It was `OSError: [Errno 28] No space left on device`, without the path. A real full disk: a 128 KiB
    tmpfs under the home's stores (root only)."""
    stores = tmp_path / "home" / "stores"
    stores.mkdir(parents=True)
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(stores)], check=False).returncode
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        line = one_sentence(launch_run(made[1], tmp_path / "home"))
        store = next(p for p in stores.iterdir() if p.suffix == ".lock").with_suffix("")
        assert line == (
            f"no space left for {store} (No space left on device); free some space on its disk, or "
            f"point CADENCE_HOME (now {tmp_path / 'home'}) at a disk with room"
        )
        assert not any(p.name.endswith(".partial") for p in stores.iterdir())  # nothing half-written left behind
    finally:
        subprocess.run(["umount", str(stores)], check=True)
