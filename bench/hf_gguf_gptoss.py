"""gpt-oss as llama.cpp's converter writes it from experts that are not in MXFP4 blocks (`conversion/gpt_oss.py`:
GptOssModel; the tiny random models' case), for bench/hf_gguf.py: arch `gpt-oss`; the fused experts transposed to
[experts, out, in] and split, gate the even rows and up the odd ones (their biases likewise); the sinks as
`attn_sinks.weight`; the names gguf-py's tensor map gives; the window and the experts' width as keys. (Released
checkpoints' MXFP4 blocks are repacked, not split, by the converter: gguf dequantizes them as cadence reads.)"""

from __future__ import annotations

import torch

ARCHS = {"gpt_oss": "gpt-oss"}


def tensors(h: dict, named):
    """(GGUF name, tensor) for each of the model's (name, tensor) in the file's order."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, h["num_hidden_layers"])

    def put(name: str, x: torch.Tensor):
        return names.get_name(name, try_suffixes=(".weight", ".bias")), x

    for name, x in named:
        x = x.to(torch.float32) if x.dtype not in (torch.float16, torch.float32) else x
        if "sinks" in name:
            name += ".weight"
        if name.endswith("down_proj_bias"):
            yield put(name.replace("down_proj_bias", "down_proj.bias"), x)
        elif name.endswith("down_proj"):
            yield put(name + ".weight", x.transpose(-1, -2))
        elif name.endswith("gate_up_proj_bias"):
            yield put(name.replace("gate_up_proj_bias", "gate_proj.bias"), x[..., ::2])
            yield put(name.replace("gate_up_proj_bias", "up_proj.bias"), x[..., 1::2])
        elif name.endswith("gate_up_proj"):
            x = x.transpose(-1, -2)
            yield put(name.replace("gate_up_proj", "gate_proj.weight"), x[:, ::2, :])
            yield put(name.replace("gate_up_proj", "up_proj.weight"), x[:, 1::2, :])
        else:
            yield put(name, x)


def params(w, h: dict, text_params) -> None:
    """GptOssModel.set_gguf_parameters: TextModel's (`text_params()`, with the expert counts), the window, the
    experts' width."""
    text_params()
    w.add_expert_count(h["num_local_experts"])
    w.add_expert_used_count(h["num_experts_per_tok"])
    w.add_sliding_window(h["sliding_window"])
    w.add_expert_feed_forward_length(h["intermediate_size"])
