"""Every CPU kernel path against the portable one (models/kernels.py, csrc/qlinear.hpp): int8, int4 and int2
give the same bits on random shapes, odd ones included; a row alone is bit for bit that row inside blocks of
2..64 on every path; the AMX kernel's code runs on emulated tiles on any AVX-512 VNNI CPU; a path the CPU
lacks is refused in one sentence, and skipped here with its name."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from common.errors import CadenceError
from models import kernels, linear
from models.transformer import Transformer
from formats.weights import TensorWeights, random_tensors
from tests.conftest import TINY

EMULATED = "amx-emulated"  # the AMX kernel on software tiles (csrc/amx_tiles.hpp), from 2 rows up
NAMES = [p.name for p in kernels.PATHS] + [EMULATED]


def path_lib(name: str):
    """A path's library, or a skip that names the path and what this CPU lacks for it."""
    have = kernels.host_paths()
    if name == EMULATED:
        if "avx512vnni" not in have:
            pytest.skip(f"{EMULATED}: its build runs on avx512vnni, which this CPU lacks")
        return kernels.load("avx512vnni", ("-DCAD_AMX_EMULATE", "-DCAD_AMX_MIN_ROWS=2"))
    if name not in have:
        lacks = sorted(set(kernels.BY_NAME[name].needs) - kernels.cpu_flags())
        pytest.skip(f"{name}: this CPU lacks {', '.join(lacks)}")
    so = kernels.load(name)
    if name == "amx":  # a CPU with AMX must run it: no tile state or a failed self-check is a failure here
        assert so.cad_kernel_path() == b"amx", "the AMX build did not get tile state or failed its self-check"
    return so


@pytest.fixture(scope="module", params=NAMES)
def path(request):
    return request.param, path_lib(request.param)


def _lin(fmt, n, k, group=32, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return linear.decode(fmt, *linear.encode(w, fmt, group_size=group))


def _x(m, k, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2


SHAPES = [
    ("int4", 203, 352, 32),
    ("int4", 37, 1536, 64),
    ("int4", 5, 96, 32),
    ("int4", 16, 8960, 32),
    ("int4", 33, 608, 32),
    ("int2", 45, 640, 32),
    ("int2", 3, 96, 32),
    ("int2", 17, 2048, 64),
    ("int8", 77, 96, 32),
    ("int8", 130, 576, 32),
    ("int8", 1, 32, 32),
]


@pytest.mark.parametrize("fmt,n,k,group", SHAPES)
def test_same_bits_as_the_portable_path(path, fmt, n, k, group):
    """Short last super-blocks (352, 96, 608: an odd number of groups in it), one group, long rows, tiles
    cut short (n not a multiple of 16), slices starting inside a tile."""
    _, so = path
    lin, x = _lin(fmt, n, k, group, seed=n + k), _x(64, k)
    with kernels.using(kernels.load("portable")):
        ref = lin(x)
    with kernels.using(so):
        assert torch.equal(lin(x), ref)
        assert torch.equal(lin.rows(n // 3, n)(x[:9]), ref[:9, n // 3 :])
        out = ref.clone()
        lin.matmul(x, out=out)
        assert torch.equal(out, ref + ref)


@pytest.mark.parametrize("fmt,k", [("int4", 352), ("int2", 384), ("int8", 320)])
def test_a_row_alone_equals_the_row_in_any_block(path, fmt, k):
    _, so = path
    lin, x = (
        _lin(fmt, 101, k, seed=7),
        _x(64, k, seed=8),
    )  # 7 tiles: int4's 4-tile blocks of wide passes and single tiles
    g = torch.Generator().manual_seed(9)
    with kernels.using(so):
        alone = torch.cat([lin(x[i : i + 1]) for i in range(64)])
        for m in range(2, 65):
            i0 = int(torch.randint(0, 65 - m, (1,), generator=g))
            assert torch.equal(lin(x[i0 : i0 + m]), alone[i0 : i0 + m]), m


def _tiny(kv_dtype: str):
    """The tiny Qwen 2, its heads 32 wide for q8 (its blocks are 32 keys' values)."""
    return dataclasses.replace(TINY["qwen"], head_dim=32) if kv_dtype == "q8" else TINY["qwen"]


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8"])
def test_a_tiny_model_gives_the_same_logits_on_every_path(path, kv_dtype):
    """The whole forward (attention, norms, rotary, SwiGLU and int4 products) is the same on each path, over float
    caches, half ones and q8 ones (--kv-dtype: the F16C conversions of the x86-64-v3 builds round as the portable
    one does, and q8_0 rows quantize alike)."""
    args = _tiny(kv_dtype)
    w = TensorWeights(args, random_tensors(args, seed=4), fmt="int4")
    toks = torch.tensor([5, 77, 200, 12, 9, 150, 151, 2, 64, 33, 260, 101])

    def logits():
        model = Transformer(args, w)
        model.kv_dtype = kv_dtype
        assert model.fused
        return model.forward(toks, torch.arange(len(toks)), model.new_cache(32))

    with kernels.using(kernels.load("portable")):
        ref = logits()
    with kernels.using(path[1]):
        assert torch.equal(logits(), ref)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8"])
def test_a_batch_of_generations_gives_each_its_logits_alone_on_every_path(path, kv_dtype):
    """A batch's layer in one call over several caches (csrc/layer.cpp `cad_layer_many`): every generation's logits
    are its forward's alone, on each path, and the same as the portable path's; over float, half and q8 caches."""
    from models import layer_kernel
    from models.batch import Rows, forward_many_steps
    from models.requests import drive

    args = _tiny(kv_dtype)
    w = TensorWeights(args, random_tensors(args, seed=4), fmt="int4")
    prompts = [torch.tensor([5, 77, 200, 12, 9]), torch.tensor([150, 151]), torch.tensor([2, 64, 33, 260, 101, 7, 8])]

    def batched():
        model = Transformer(args, w)
        model.kv_dtype = kv_dtype
        assert model.layer_calls and layer_kernel.record(w.layer(0), args, 0) is not None  # the one call takes it
        rows = [Rows(t, torch.arange(len(t)), model.new_cache(32)) for t in prompts]
        return drive(forward_many_steps(model, rows), w)

    def alone():
        model = Transformer(args, w)
        model.kv_dtype = kv_dtype
        return [model.forward(t, torch.arange(len(t)), model.new_cache(32)) for t in prompts]

    with kernels.using(kernels.load("portable")):
        ref = batched()
    with kernels.using(path[1]):
        got, each = batched(), alone()
    for g, r, a in zip(got, ref, each):
        assert torch.equal(g, r) and torch.equal(g, a)


def test_a_path_the_cpu_lacks_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.setenv(kernels.ENV_PATH, "sse9")
    with pytest.raises(CadenceError, match="sse9 is not a kernel path; choose one of"):
        kernels.chosen_path()
    lacking = [p.name for p in kernels.PATHS if p.name not in kernels.host_paths()]
    if not lacking:
        pytest.skip("this CPU has every kernel path: none to refuse")
    monkeypatch.setenv(kernels.ENV_PATH, lacking[0])
    with pytest.raises(CadenceError, match=f"{lacking[0]} needs the CPU flags .* which this CPU lacks; it runs"):
        kernels.chosen_path()


def test_the_forced_path_is_the_one_a_process_runs():
    for name in kernels.host_paths():
        p = subprocess.run(
            [sys.executable, "-c", "from models import kernels; print(kernels.active_path())"],
            env=_env(CADENCE_KERNEL_PATH=name),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.split() == [name], name


CHILD = """
import sys, torch
from models import kernels, linear
so = kernels.load("amx", ask_tiles=False)
w = torch.randn(45, 576, generator=torch.Generator().manual_seed(3)) * 0.05
lin = linear.decode("int4", *linear.encode(w, "int4"))
with kernels.using(so):
    y = lin(torch.randn(40, 576, generator=torch.Generator().manual_seed(4)))
torch.save(y, sys.argv[1])
print(so.cad_kernel_path().decode())
"""


def test_a_process_that_did_not_ask_for_tiles_falls_back_to_the_same_bits(tmp_path):
    """Where the CPU has AMX, this process asked for tile state and runs AMX; a process that did not ask
    runs the VNNI path of the same build, with the same bits. Elsewhere both run that VNNI path."""
    if "avx512vnni" not in kernels.host_paths():
        pytest.skip("amx: the AMX build runs on avx512vnni, which this CPU lacks")
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "y.pt")], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["avx512vnni"]
    so = kernels.load("amx")
    assert so.cad_kernel_path() == (b"amx" if "amx" in kernels.host_paths() else b"avx512vnni")
    w = torch.randn(45, 576, generator=torch.Generator().manual_seed(3)) * 0.05
    lin = linear.decode("int4", *linear.encode(w, "int4"))
    with kernels.using(so):
        assert torch.equal(
            lin(torch.randn(40, 576, generator=torch.Generator().manual_seed(4))), torch.load(tmp_path / "y.pt")
        )


def _env(**kw):
    import os

    return dict(os.environ, **kw)
