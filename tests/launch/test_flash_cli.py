"""`launch models bundle` and `launch models read-curve` as a user runs them, on a tiny model; bad input in one
sentence."""

import json

from tests.launch.conftest import launch, one_clear_line


def test_bundle_and_read_curve_write_their_files_and_refuse_bad_input(tiny_gguf, tmp_path):
    home = tmp_path / "home"
    line = one_clear_line(launch("models", "bundle", str(tiny_gguf), "--chunk-neurons", "0", home=home))
    assert "--chunk-neurons 0: a chunk holds at least one neuron" in line
    p = launch("models", "bundle", str(tiny_gguf), "--chunk-neurons", "3", home=home, check=True)
    store = next(d for d in (home / "stores").glob("tiny-int4g32-*") if d.is_dir())
    section = json.loads((store / "manifest.json").read_text())["bundles"]
    assert "bundles.bin" in p.stdout and section["chunk_neurons"] == 3
    assert (store / "bundles.bin").stat().st_size == section["file_bytes"]
    p = launch("models", "read-curve", str(store), home=home, check=True)
    assert "| 4 KiB |" in p.stdout and (home / "read-curve.json").is_file()
    p = launch("models", "bundle", str(tiny_gguf), home=home, check=True)  # the chunk the curve favours
    assert "to a chunk" in p.stdout
    p = launch("models", "convert", str(tiny_gguf), "--dtype", "int8", home=home, check=True)
    int8 = next(d for d in (home / "stores").glob("tiny-int8-*") if d.is_dir())
    line = one_clear_line(launch("models", "bundle", str(int8), home=home))
    assert "FFN bundles are written for int4 weight stores" in line and "is int8" in line
