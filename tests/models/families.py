"""Tiny random-weight models of more families, built by transformers itself and saved as real HF directories.

`tiny_hf(model_type, variant, folder, spelling)` writes config.json (as the installed transformers 5 saves it, or
as transformers 4 spelled it: `spell_4`), model.safetensors (float32) and a small byte-level BPE tokenizer;
`write_gguf_like_llama_cpp` (bench/hf_gguf.py) writes the same model as llama.cpp's converter does.
`VARIANTS` names each family's variants. Shapes: hidden 64, 4 heads / 2 kv heads, head_dim 16 (32 where the family
has an explicit one: mistral like Nemo, qwen3, gemma), 2 layers (gemma2 4, gemma3 6: sliding and full layers both),
vocabulary 320, every sliding window 8 tokens. Each builds in well under a second.

What the variants exercise: llama `llama3` (wavelength-dependent rope rescaling: with head_dim 16 and
original_max_position_embeddings 64 one dimension keeps its frequency, one is smoothed, six are divided by 8);
mistral `sliding`; gemma2 `plain` (Gemma 2's own caps, 50 / 30, which barely bite here) and `softcap` (12 / 8, which
do); gemma3 `linear` (rope scaling on the full-attention layers only, like Gemma 3 4B+); phi3 `partial` (Phi-4-mini's
partial_rotary_factor 0.75), `longrope` (Phi-3-mini-128k's short/long factors, original context 32 of 128) and
`partial_longrope` (both, tied, as Phi-4-mini); granite's four multipliers; qwen2 `sliding` (layer 0 full, layer 1
sliding, from use_sliding_window + max_window_layers). Gemma's query_pre_attn_scalar equals head_dim (32, not
hidden / heads = 16): a GGUF has no key for it and llama.cpp uses 1/sqrt(head_dim) (1/sqrt(hidden / heads) for the
27B), so only such a model means the same in both files.

`python -m tests.models.families DIR` runs `self_check` (not a CI test; about 10 seconds)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from bench.hf_gguf import QWEN2_SPLIT  # the tokenizer.json's pre-tokenizer: Qwen2's split (llama.cpp's "qwen2")

VOCAB = 320
MERGES = ["Ġ t", "Ġ a", "i n", "h e"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def vocab_tokens() -> list[str]:
    """GPT-2's 256 byte characters (printable bytes first), the merges' results, the specials, <unusedN> up to VOCAB
    (the same vocabulary as tests/models/tiny_files.py's)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars = [chr(b) for b in bs] + [chr(256 + n) for n in range(256 - len(bs))]
    toks = chars + [m.replace(" ", "") for m in MERGES] + SPECIALS
    return toks + [f"<unused{i}>" for i in range(VOCAB - len(toks))]


_TOKS = vocab_tokens()
BOS, EOS = _TOKS.index("<|endoftext|>"), _TOKS.index("<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WINDOW = 8  # every sliding window: a 10-token prompt already runs past it

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=BOS,
    tie_word_embeddings=False,
)
_GEMMA = dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW, tie_word_embeddings=True)
_GEMMA4 = {
    "plain": dict(attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=30.0),
    "ple": dict(vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, use_double_wide_mlp=True),
    "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
}
_LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
_SCOUT_ROPE = dict(
    rope_type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_position_embeddings=8192
)
# Phi-3-mini-128k style factors: short ones near 1, long ones growing with the dimension (8 = head_dim / 2, 6 at 0.75)
_SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6]
_LONG = [1.0, 1.2, 1.8, 3.0, 5.5, 9.0, 14.0, 20.0]


def _rope(theta: float, **kw) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **kw}}


_LFM2_MOE = dict(
    num_hidden_layers=4,
    layer_types=["conv", "full_attention", "conv", "full_attention"],
    num_dense_layers=1,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    routed_scaling_factor=1.5,
    **_rope(1e6),
)


def _phi3(partial: float, longrope: bool) -> dict:
    n = int(16 * partial) // 2
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    if not longrope:
        return dict(rope_parameters=rope, original_max_position_embeddings=256, rms_norm_eps=1e-6)
    rope.update(rope_type="longrope", short_factor=_SHORT[:n], long_factor=_LONG[:n])
    return dict(
        rope_parameters=rope, max_position_embeddings=128, original_max_position_embeddings=32, rms_norm_eps=1e-6
    )


# model_type -> variant -> the config's arguments beyond _COMMON
FAMILIES: dict[str, dict[str, dict]] = {
    "llama": {
        "plain": _rope(500000.0),
        "llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3}},
    },
    "mistral": {
        "plain": dict(head_dim=32, sliding_window=None, **_rope(1e6)),
        "sliding": dict(head_dim=32, sliding_window=WINDOW, **_rope(1e6)),
    },
    "gemma2": {
        "plain": dict(num_hidden_layers=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **_GEMMA),
        "softcap": dict(num_hidden_layers=4, attn_logit_softcapping=12.0, final_logit_softcapping=8.0, **_GEMMA),
    },
    "gemma3_text": {
        "plain": dict(num_hidden_layers=6, **_GEMMA),
        "linear": dict(
            num_hidden_layers=6,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            **_GEMMA,
        ),
    },
    "phi3": {
        "plain": _phi3(1.0, False),
        "partial": _phi3(0.75, False),
        "longrope": _phi3(1.0, True),
        "partial_longrope": dict(_phi3(0.75, True), tie_word_embeddings=True),  # Phi-4-mini's combination
    },
    "granite": {
        "plain": dict(
            embedding_multiplier=4.0,
            attention_multiplier=0.125,
            residual_multiplier=0.5,
            logits_scaling=2.0,
            tie_word_embeddings=True,
            **_rope(100000.0),
        ),
    },
    "olmo2": {"plain": dict(rms_norm_eps=1e-6, **_rope(500000.0))},
    "qwen3": {"plain": dict(head_dim=32, tie_word_embeddings=True, **_rope(1e6))},
    "smollm3": {"plain": dict(num_hidden_layers=4, **_rope(2e6))},  # layer 3 takes no rope
    "olmo3": {"plain": dict(num_hidden_layers=4, sliding_window=WINDOW, rms_norm_eps=1e-6, **_rope(500000.0))},
    "seed_oss": {"plain": dict(head_dim=32, attention_bias=True, attention_dropout=0.0, **_rope(1e7))},
    "exaone4": {
        "plain": dict(num_hidden_layers=4, sliding_window=WINDOW, sliding_window_pattern=4, **_rope(1e6)),
        # the 1.2B: every layer full, every layer rotates (transformers cannot derive its layer_types: given)
        "global": dict(sliding_window=None, layer_types=["full_attention"] * 2, **_rope(1e6)),
    },
    "glm4": {"plain": dict(head_dim=16, attention_bias=True, **_rope(10000.0, partial_rotary_factor=0.5))},
    "ministral3": {  # YaRN over 16 positions, so a 60-token prompt's queries reach a temperature of 1 + 0.1 ln 4
        "plain": dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 16.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
        )
    },
    "lfm2": {  # convolution layers around two attention layers; a 3-tap kernel, the FFN width adjusted (2/3, x16)
        "plain": dict(
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            block_multiple_of=16,
            tie_word_embeddings=True,
            **_rope(1e6),
        )
    },
    "qwen3_5_text": {  # delta-nets (2 key heads serving 4 value heads) around one gated attention layer in four
        "plain": dict(
            num_hidden_layers=4,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=True,
            **_rope(1e7, partial_rotary_factor=0.25),
        )
    },
    "granitemoehybrid": {  # Mamba-2 layers (4 heads in 2 groups) around a NoPE attention layer, muP multipliers
        "plain": dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            num_local_experts=0,
            shared_intermediate_size=96,
            mamba_n_heads=4,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_head=16,
            mamba_d_conv=4,
            mamba_expand=1,
            embedding_multiplier=4.0,
            attention_multiplier=0.125,
            residual_multiplier=0.5,
            logits_scaling=2.0,
            tie_word_embeddings=True,
            **_rope(10000.0),
        )
    },
    "nemotron_h": {  # a layer a part: Mamba-2, MLP (relu^2), NoPE attention, MLP
        "plain": dict(
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            head_dim=16,
            ssm_state_size=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            conv_kernel=4,
            layer_norm_epsilon=1e-5,
        )
    },
    "falcon_h1": {  # Mamba-2 beside attention in every layer, muP multipliers everywhere; its three output norms
        v: dict(
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_rms_norm=v != "plain",
            mamba_norm_before_gate=v == "normed",
            embedding_multiplier=2.0,
            lm_head_multiplier=0.5,
            key_multiplier=0.6,
            attention_in_multiplier=1.3,
            attention_out_multiplier=0.8,
            ssm_in_multiplier=1.2,
            ssm_out_multiplier=0.7,
            ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 0.6],
            mlp_multipliers=[1.4, 0.75],
            **_rope(10000.0),
        )
        for v in ("plain", "normed", "gated")
    },
    "gemma4_text": {  # 5 sliding layers to 1 full, full layers with wider heads of their own (proportional rope)
        # "plain": like the 31B (values = keys on the full layers, one kv head there, logits capped); "ple": like E2B
        # (per-layer embeddings, the last two layers sharing earlier ones' keys and values, their MLP twice as wide);
        # "moe": like the 26B-A4B (4 GeGLU experts, 2 a token, beside the dense MLP in every layer)
        v: dict(
            num_hidden_layers=6,
            head_dim=16,
            global_head_dim=32,
            sliding_window=WINDOW,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=32 if v == "ple" else 0,
            **_GEMMA4[v],
        )
        for v in ("plain", "ple", "moe")
    },
    "mistral4": {  # latent attention (YaRN with mscale, interleaved rotary pairs, position-scaled queries), a dense
        # first layer, then 4 softmax-routed experts (2 a token, scaled) beside a shared one; "untempered": queries
        # not scaled by position (beta 0: what llama.cpp's GGUF of it can say)
        v: dict(
            num_key_value_heads=4,  # a key head per query head, as MLA expands them
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=16,
            kv_lora_rank=32,
            q_lora_rank=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1 if v == "plain" else 0.0,
            },
        )
        for v in ("plain", "untempered")
    },
    "gpt_oss": {  # sinks, biases, sliding layers among full ones, YaRN untruncated; 4 experts, 2 a token
        "plain": dict(
            num_hidden_layers=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        )
    },
    "qwen3_5_moe_text": {  # Qwen 3.5's layers with 4 experts (2 a token) and a shared one
        "plain": dict(
            num_hidden_layers=4,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            **_rope(1e7, partial_rotary_factor=0.25),
        )
    },
    "lfm2_moe": {  # LFM2's layers, the first FFN dense, then 4 experts (2 a token) by sigmoid scores and a bias
        "plain": _LFM2_MOE,
        # as the released LFM2-8B-A1B: no routed scale (what llama.cpp's GGUF can say), two dense layers
        "unscaled": {**_LFM2_MOE, "layer_types": ["full_attention", "conv", "conv", "full_attention"]}
        | {"num_dense_layers": 2, "routed_scaling_factor": 1.0},
    },
    "glm4_moe": {  # the first FFN dense, then 4 experts (2 a token) by sigmoid scores and a choosing bias, one shared;
        # "air": no q/k norms (GLM-4.5-Air's)
        v: dict(
            num_hidden_layers=3,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=v == "plain",
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            **_rope(10000.0, partial_rotary_factor=0.5),
        )
        for v in ("plain", "air")
    },
    "qwen3_next": {  # fused, grouped delta-net projections; 4 experts (2 a token) and a shared one; layer 1 dense
        "plain": dict(
            num_hidden_layers=4,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            **_rope(1e7, partial_rotary_factor=0.25),
        )
    },
    "olmo_hybrid": {  # pre-norm delta-nets (4 heads of 8 / 16, beta up to 2) around a post-norm rotary attention layer
        "plain": dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            **_rope(500000.0),
        )
    },
    "llama4_text": {  # chunks of 8, L2 q/k norms, layer 3 NoPE and tempered (floor 8); experts (top-1) on layers 1, 3;
        # "released": the chunks and the temperature's floor of the released checkpoints (8192, what llama.cpp fixes
        # for every Llama 4 GGUF) and Scout's Llama 3 rope scaling
        v: dict(
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=32,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=WINDOW if v == "plain" else 8192,
            floor_scale=8 if v == "plain" else 8192,
            attn_scale=0.1,
            use_qk_norm=True,
            **(_rope(500000.0) if v == "plain" else _rope(500000.0, **_SCOUT_ROPE)),
        )
        for v in ("plain", "released")
    },
    "qwen2": {
        "plain": dict(tie_word_embeddings=True, **_rope(1e6)),
        "sliding": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **_rope(1e6)),
    },
}
VARIANTS: dict[str, tuple[str, ...]] = {m: tuple(v) for m, v in FAMILIES.items()}
GEMMA_NORMS = ("gemma2", "gemma3_text")  # RMSNorm weights stored as w, applied as (1 + w)
# Gemma's embeddings (x sqrt(hidden)) and tied head make a random model repeat its last token unless the branches
# outweigh the embedding: its norms are drawn around (1 + w) = 3 and its matrices smaller.
SCALE = {"gemma2": 1.0, "gemma3_text": 1.0, "granite": 2.5, "olmo2": 1.0, "qwen3": 1.0}  # else 1.5: chosen so that
# seed 0's greedy tokens wander (no family repeats one token from a 60-token prompt)


def family_config(model_type: str, variant: str):
    """The transformers 5 config object of a family's variant."""
    from transformers import AutoConfig

    if variant not in FAMILIES[model_type]:
        raise KeyError(f"{model_type} has variants {VARIANTS[model_type]}, not {variant!r}")
    kw = {**_COMMON, **copy.deepcopy(FAMILIES[model_type][variant])}
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.architectures = [type(cfg).__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    return cfg


def _randomise(model, model_type: str, seed: int) -> None:
    """Every parameter drawn anew: matrices ~ N(0, scale^2 / fan_in), norms around their identity, biases small."""
    g = torch.Generator().manual_seed(seed)
    scale = SCALE.get(model_type, 1.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):  # (Gemma 4's router's scales)
                x = (2.0 + 0.3 * x) if model_type in GEMMA_NORMS else 1.0 + 0.25 * x
                if name == "model.norm.weight" and model_type not in GEMMA_NORMS:
                    x = 3.0 * x  # logits ~ 3x wider: the greedy margins well clear of float noise
            elif p.ndim >= 2:
                x = x * (scale / p.shape[-1] ** 0.5)
            else:
                x = 0.1 * x
            p.copy_(x)
        for name, b in model.named_buffers():  # a router's bias that only chooses: large enough to change a choice
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
            if name.endswith("layer_scalar"):  # Gemma 4's scale of a layer's output
                b.copy_(1.0 + 0.2 * torch.randn(b.shape, generator=g))


def write_tokenizer(folder: Path, tokenizer_class: str = "PreTrainedTokenizerFast") -> None:
    """tokenizer.json (a byte-level BPE with Qwen2's split regex, built with `tokenizers`) + tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    toks = vocab_tokens()
    bpe = models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=[tuple(m.split(" ")) for m in MERGES])
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    (folder / "tokenizer.json").write_text(tok.to_str())
    tc = {
        "tokenizer_class": tokenizer_class,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))


def causal_lm(model_type: str):
    """transformers' causal-LM class of the family (Mistral 4's is not among AutoModelForCausalLM's)."""
    from transformers import AutoModelForCausalLM

    if model_type == "mistral4":
        from transformers.models.mistral4.modeling_mistral4 import Mistral4ForCausalLM

        return Mistral4ForCausalLM
    return AutoModelForCausalLM


def tiny_hf(
    model_type: str, variant: str, folder: Path, spelling: int = 5, seed: int = 0, wide_heads: bool = False
) -> Path:
    """A complete HF model directory of a tiny random model of the family: config.json spelled as transformers
    `spelling` (4 or 5) wrote it, model.safetensors (float32), tokenizer.json and tokenizer_config.json.
    `wide_heads`: two attention heads of 32 (one KV head) instead of four of 16 (a q8 KV cache's blocks)."""
    if spelling not in (4, 5):
        raise ValueError(f"spelling is 4 or 5, not {spelling}")
    cfg = family_config(model_type, variant)
    if wide_heads:
        cfg.num_attention_heads, cfg.num_key_value_heads = 2, 1
        cfg.allow_global_per_layer_attribute_access = True  # (Gemma 4: heads of their own size per kind of layer)
        for name in ("head_dim", "global_head_dim"):
            if getattr(cfg, name, None):
                setattr(cfg, name, 32)
    torch.manual_seed(seed)
    cls = causal_lm(model_type)
    model = (cls.from_config if hasattr(cls, "from_config") else cls._from_config)(cfg, dtype=torch.float32)
    _randomise(model, model_type, seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    if wide_heads:  # (set above to change the heads; transformers' own switch, no part of the model)
        cfg5 = json.loads((folder / "config.json").read_text())
        cfg5.pop("allow_global_per_layer_attribute_access", None)
        (folder / "config.json").write_text(json.dumps(cfg5, indent=2, sort_keys=True) + "\n")
    if spelling == 4:
        cfg5 = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(spell_4(cfg5), indent=2, sort_keys=True) + "\n")
    write_tokenizer(folder, "GPT2Tokenizer" if model_type == "phi3" else "PreTrainedTokenizerFast")
    return folder


def spell_4(cfg: dict) -> dict:
    """config.json as transformers 4 wrote it for the family (from the dict transformers 5 saved)."""
    d = dict(cfg)
    mt = d["model_type"]
    d["torch_dtype"] = d.pop("dtype", "float32")
    d["transformers_version"] = "4.51.3"
    if mt == "nemotron_h":  # transformers 4: the layer kinds as a pattern string, no rope at all
        pattern = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
        d["hybrid_override_pattern"] = "".join(pattern[t] for t in d.pop("layers_block_type"))
        d["num_hidden_layers"] = len(d["hybrid_override_pattern"])
        d.pop("rope_parameters", None)
        return d
    if mt == "gemma4_text":  # no transformers 4 knew Gemma 4: its release checkpoints' spelling of the full heads
        per = d.pop("per_layer_config")
        o = next(iter(per.values()))
        d["global_head_dim"] = o["head_dim"]
        if "num_key_value_heads" in o:
            d["num_global_key_value_heads"] = o["num_key_value_heads"]
        return d
    rp = copy.deepcopy(d.pop("rope_parameters"))
    if mt == "gemma3_text":
        full, sliding = rp["full_attention"], rp["sliding_attention"]
        d["rope_theta"], d["rope_local_base_freq"] = full.pop("rope_theta"), sliding.pop("rope_theta")
        d["rope_scaling"] = None if full["rope_type"] == "default" else full
        types = d.pop("layer_types")
        n = types.index("full_attention") + 1
        assert types == ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(len(types))]
        d["sliding_window_pattern"] = n
        d["cache_implementation"] = "hybrid"
        d.pop("_sliding_window_pattern", None)
    else:
        d["rope_theta"] = rp.pop("rope_theta")
        if (prf := rp.pop("partial_rotary_factor", 1.0)) != 1.0:
            d["partial_rotary_factor"] = prf
        if mt == "phi3":
            rp.pop("original_max_position_embeddings", None)  # phi3 keeps it at the top level
            if rp.get("rope_type") == "longrope":
                rp = {"long_factor": rp["long_factor"], "short_factor": rp["short_factor"], "type": "longrope"}
        d["rope_scaling"] = None if rp.get("rope_type") == "default" else rp
    if mt == "granitemoehybrid":  # transformers 4's layer kinds: mamba and attention
        d["layer_types"] = [{"linear_attention": "mamba", "full_attention": "attention"}[t] for t in d["layer_types"]]
    if mt in ("gemma2", "gemma3_text"):
        d.pop("use_bidirectional_attention", None)  # added in transformers 5
    if mt == "gemma2":
        n = len(d["layer_types"])
        assert d.pop("layer_types") == ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        d["cache_implementation"] = "hybrid"
    if mt in ("qwen2", "qwen3"):  # transformers 4 derived the sliding layers from use_sliding_window, max_window_layers
        types = d.pop("layer_types")
        w, m = d["sliding_window"] if d["use_sliding_window"] else None, d["max_window_layers"]
        assert types == ["sliding_attention" if w and i >= m else "full_attention" for i in range(len(types))]
        if mt == "qwen2" and w is None:  # Qwen2.5's configs carry a window that use_sliding_window switches off
            d["sliding_window"] = d["max_position_embeddings"]
    return d


def write_gguf_like_llama_cpp(hf_folder: Path, out: Path, qtype: str = "F32") -> Path:
    """bench/hf_gguf.py's writer: the model as llama.cpp's convert_hf_to_gguf.py writes it."""
    from bench.hf_gguf import write_gguf_like_llama_cpp as write

    return write(hf_folder, out, qtype)


PROMPT = "The quick brown fox jumps over the lazy dog; then it ran 42 laps."  # 60 tokens
_INERT = {"_name_or_path", "transformers_version", "sliding_window_pattern", "_sliding_window_pattern"}


def _read_config(folder: Path) -> dict:
    """transformers 5's reading of config.json, less what a transformers 4 spelling leaves as inert attributes."""
    from transformers import AutoConfig

    d = {k: v for k, v in AutoConfig.from_pretrained(folder).to_dict().items() if k not in _INERT}
    d.pop("cache_implementation", None)
    rope = d.get("rope_parameters") or {}
    for r in (rope, *(v for v in rope.values() if isinstance(v, dict))):
        r.pop("type", None)  # transformers 4's rope_scaling "type", kept beside the "rope_type" it became
    if d.get("partial_rotary_factor", -1) == rope.get("partial_rotary_factor"):
        del d["partial_rotary_factor"]
    return d


def self_check(root: Path, n_tokens: int = 16) -> None:
    """For every family and variant: the two spellings read to the same transformers 5 config and run to identical
    logits on PROMPT, and seed 0's greedy tokens after it are not one token repeated. Prints a line per variant."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    for mt, variants in VARIANTS.items():
        for v in variants:
            d5, d4 = (tiny_hf(mt, v, Path(root) / f"{mt}-{v}-s{s}", spelling=s) for s in (5, 4))
            c5, c4 = _read_config(d5), _read_config(d4)
            assert c5 == c4, (
                mt,
                v,
                {k: (c4.get(k), c5.get(k)) for k in c4.keys() | c5.keys() if c4.get(k) != c5.get(k)},
            )
            ids = Tokenizer.from_file(str(d5 / "tokenizer.json")).encode(PROMPT).ids
            m5, m4 = (AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval() for d in (d5, d4))
            seq, margins = list(ids), []
            with torch.no_grad():
                assert torch.equal(m5(torch.tensor([ids])).logits, m4(torch.tensor([ids])).logits), (mt, v)
                for _ in range(n_tokens):
                    top = m5(torch.tensor([seq])).logits[0, -1].topk(2)
                    margins.append(float(top.values[0] - top.values[1]))
                    seq.append(int(top.indices[0]))
            out = seq[len(ids) :]
            assert len(set(out)) > 1, (mt, v, out)
            print(
                f"{mt:12s} {v:17s} same config and logits in both spellings; greedy: {len(set(out)):2d} distinct "
                f"of {n_tokens}, smallest top-2 margin {min(margins):.3f}: {out}"
            )


if __name__ == "__main__":
    import sys
    import tempfile

    self_check(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
