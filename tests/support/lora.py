"""Tiny LoRA adapters for the real-engine bed, written by hand in PEFT's layout (no ``peft`` needed).

    python tests/support/lora.py MODEL_DIR OUT_DIR [--seed N] [--rank R]

``make_adapter`` reads the base model's ``config.json`` (a Llama: hidden size, heads, KV heads,
intermediate size, layers) and writes ``OUT_DIR/adapter_config.json`` (``peft_type`` LORA,
``task_type`` CAUSAL_LM) and ``OUT_DIR/adapter_model.safetensors`` with tensors named
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]), seeded random weights of small scale (float32). The same arguments give the same bytes.

Only the standard library is needed to import this module; ``numpy`` and ``safetensors`` are imported
when an adapter is written (both are in the bed's venv).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["make_adapter", "module_shapes"]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each Llama projection a LoRA may target, from a model config."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    rank: int = 8,
    seed: int = 0,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    lora_alpha: int | None = None,
    scale: float = 0.02,
) -> Path:
    """Writes a LoRA adapter for the model in ``model_dir`` to ``out_dir`` (created); returns ``out_dir``.

    ``lora_alpha`` defaults to ``2 * rank``; the weights are N(0, ``scale``) from ``numpy``'s PCG64
    seeded with ``seed``, drawn layer by layer in ``target_modules`` order, A before B."""
    import numpy as np
    from safetensors.numpy import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    shapes = module_shapes(config)
    unknown = [m for m in target_modules if m not in shapes]
    if unknown:
        raise ValueError(f"unknown target modules {unknown}; known: {sorted(shapes)}")
    layers = int(config["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for i in range(layers):
        for m in target_modules:
            fan_in, fan_out = shapes[m]
            block = "self_attn" if m in _ATTN else "mlp"
            prefix = f"base_model.model.model.layers.{i}.{block}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * scale).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * scale).astype(np.float32)

    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir.resolve()),
        "r": rank,
        "lora_alpha": lora_alpha if lora_alpha is not None else 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "revision": None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    save_file(
        tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"}
    )  # one key: the header is a hash map, its order varies
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="lora", description="write a tiny seeded LoRA adapter (PEFT layout)")
    p.add_argument("model_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--target-modules", default="q_proj,v_proj", help="comma-separated (default: q_proj,v_proj)")
    a = p.parse_args(argv)
    mods = tuple(m for m in a.target_modules.split(",") if m)
    print(make_adapter(a.model_dir, a.out_dir, rank=a.rank, seed=a.seed, target_modules=mods))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
