"""`launch models train-predictor|bundle|read-curve`: LLM in a flash's predictor, bundles and read curve."""

from __future__ import annotations

import sys


from common.errors import CadenceError
from pulls import registry
from common.bars import count_bar
from formats.convert import ensure_store
from flash.footprint import KINDS
from launch.options import add_calibration, add_model_action


def add_flash(msub) -> None:
    """LLM in a flash: the predictor, the bundles and the read curve."""
    pt = add_model_action(
        msub,
        "train-predictor",
        "a dense SwiGLU model: make LLM in a flash's activation predictor (int2: the FFN's own gate and up weights "
        "in 2 bits; lowrank: fitted on calibration prompts), measure its recall and write it beside the weight store",
        "a default model name, a .gguf file or an HF model directory",
        cmd_train_predictor,
    )
    add_calibration(pt, "the weight store (as --dtype of run)", "recorded too")
    pt.add_argument(
        "--heldout", default=None, help="prompts to measure recall on (JSONL; default: every 4th calibration prompt)"
    )
    pt.add_argument(
        "--kind",
        choices=KINDS,
        default=None,
        help="int2 (the default; larger, finds more of the neurons that matter) or lowrank (smaller, for tight budgets)",
    )
    pt.add_argument("--rank", type=int, default=None, help="a low-rank predictor's rank (default 128; implies lowrank)")
    pt.add_argument("--density", type=float, default=0.3, help="the share of neurons per token recall is measured at")
    pf = add_model_action(
        msub,
        "bundle",
        "LLM in a flash: write an int4 store's FFN bundles (each neuron's gate row, up row and down column together) "
        "beside its dense layout",
        "a default model name, a .gguf file, an HF model directory or an int4 weight store",
        cmd_bundle,
    )
    pf.add_argument(
        "--chunk-neurons",
        type=int,
        default=None,
        help="neurons per chunk (default: the size this machine's read curve favours)",
    )
    pv = msub.add_parser(
        "read-curve", help="measure this machine's random-read throughput by read size (the flash cost model's)"
    )
    pv.add_argument(
        "name", nargs="?", default=registry.DEFAULT_TARGET, help="the model whose int4 store's file is read"
    )
    pv.set_defaults(func=cmd_read_curve)


def cmd_train_predictor(args) -> int:
    """LLM in a flash §3.1: flash/train.py on the prompts' token ids (encoded here: models/ reads no prompts)."""
    from engine.prompts import DEFAULT_PROMPTS, encode_prompt, load_prompts
    from formats import loading
    from flash.footprint import INT2
    from flash.train import FitConfig, fit

    kind = args.kind or ("lowrank" if args.rank is not None else INT2)
    cfg = FitConfig(kind=kind, rank=args.rank, density=args.density, tokens=args.tokens)  # refuses bad values
    st = ensure_store(args.name, args.fmt)
    if st.args.moe:
        raise CadenceError(f"{args.name} is a mixture of experts; the activation predictor is for dense SwiGLU models")
    lm = loading.load_store(st)
    encode = lambda ps: [encode_prompt(lm.tokenizer, p, "auto", st.args.context_length)[0] for p in ps]  # noqa: E731
    cal = load_prompts(args.prompts or DEFAULT_PROMPTS)
    held = load_prompts(args.heldout) if args.heldout else cal[3::4]
    if not args.heldout:
        cal = [p for n, p in enumerate(cal) if n % 4 != 3]
    if not cal or not held:
        raise CadenceError("give at least two calibration prompts, or held-out prompts with --heldout")
    p = fit(lm.model, encode(cal), encode(held), cfg, say=print)
    path = p.save(st)
    r = p.recall
    print(
        f"{path}: the {p.name} predictor, {path.stat().st_size / 1e6:.1f} MB; recall of each token's top {args.density:g} "
        f"of neurons on {r['heldout_tokens']} held-out tokens: mean {r['mean']:.3f}, worst layer {r['worst_layer']} "
        f"{r['min']:.3f}; activation mass held {r['mass_mean']:.3f}"
    )
    return 0


def cmd_bundle(args) -> int:
    """LLM in a flash §3.2: the bundled FFN layout beside the store (flash/bundles.py)."""
    import time

    from flash import bundles

    st = ensure_store(args.name, "int4")
    bundles.check_store(st)
    if args.chunk_neurons is not None and args.chunk_neurons < 1:
        raise CadenceError(f"--chunk-neurons {args.chunk_neurons}: a chunk holds at least one neuron")
    say = lambda line: print(line, file=sys.stderr)
    chunk = args.chunk_neurons or bundles.favoured_chunk_neurons(st, say)
    t0 = time.time()
    with count_bar() as bar:
        task = bar.add_task(f"bundles of {st.dir.name}", total=st.args.n_layers)
        lay = bundles.write(st, chunk, progress=lambda: bar.advance(task))
    print(
        f"{st.dir / bundles.FILE}: {lay.file_bytes / 1e6:.0f} MB, {lay.ffn_dim} neurons x {lay.n_layers} layers, "
        f"{lay.record} bytes a neuron, {lay.chunk_neurons} to a chunk ({time.time() - t0:.0f} s)"
    )
    return 0


def cmd_read_curve(args) -> int:
    from flash.costmodel import curve_path, measure_curve

    st = ensure_store(args.name, "int4")
    curve = measure_curve(st.path, say=lambda line: print(line, file=sys.stderr))
    print("| read size | GB/s |\n| --- | ---: |")
    for size, gbps in zip(curve.sizes, curve.gbps):
        print(f"| {size // 1024} KiB | {gbps:.3f} |")
    print(f"{curve.threads} reads in flight; kept at {curve_path()}")
    return 0
