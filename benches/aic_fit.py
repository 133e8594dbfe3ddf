"""Fits the realistic engine model's timing (`kvroute.sim.aisim.PolyFit`) to NVIDIA AIConfigurator's
offline performance data for a model on a GPU, so `kvroute simulate --engine aisim --timing-fit`
runs engines of that model and hardware instead of AISimulate's unnamed built-in fit.

AIConfigurator's data ships in the `aiconfigurator-core` wheel on PyPI (measured kernel tables for
H100, H200, B200, GB200, ...; no network at run time). It is not a kvroute dependency:

    pip install aiconfigurator-core==0.12.0
    python benches/aic_fit.py --model Qwen/Qwen3-32B --system h100_sxm --backend vllm --tp 2 \\
        --out benches/data/aic_qwen3-32b_h100-sxm_tp2_vllm.json

Prefill: one request of ``t`` new tokens per pass, ``t`` over the step budget's range, fitted by
least squares (on relative error) as ``a t^2 + b t + c`` ms. Decode: one step of ``batch`` requests at context ``ctx``,
fitted against the share ``u = batch * ctx / pool`` of the KV pool they hold (``--kv-blocks`` x
``--block-size`` tokens: give the engine model the same pool), ``a u^2 + b u + c`` ms. AIConfigurator's
decode time depends on batch and context separately; the fit keeps only their product, and the
script prints how far the fit is from the data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def fit_quadratic(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares on relative error (short passes matter as much as long ones)."""
    a, b, c = np.polyfit(x, y, 2, w=1.0 / y)
    return float(a), float(b), float(c)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen3-32B", help="a model AIConfigurator knows (default Qwen/Qwen3-32B)")
    ap.add_argument("--system", default="h100_sxm", help="GPU system in AIConfigurator's data (default h100_sxm)")
    ap.add_argument("--backend", default="vllm", help="vllm, sglang or trtllm (default vllm)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of one engine (default 1)")
    ap.add_argument("--kv-blocks", type=int, default=16384, help="the engine's KV pool in blocks (default 16384)")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per block (default 64)")
    ap.add_argument("--budget", type=int, default=8192, help="the step's token budget (default 8192)")
    ap.add_argument("--out", help="write the fit here (PolyFit fields as JSON; default: print it)")
    a = ap.parse_args(argv)
    try:
        import aiconfigurator_core
        from aiconfigurator_core.sdk.engine import compile_engine
    except ImportError:
        raise SystemExit("aic_fit: needs AIConfigurator's data: pip install aiconfigurator-core==0.12.0") from None
    if a.tp < 1 or a.kv_blocks < 1 or a.block_size < 1 or a.budget < 64:
        raise SystemExit("aic_fit: --tp, --kv-blocks, --block-size must be >= 1 and --budget >= 64")
    try:
        engine = aiconfigurator_core.AicEngine.from_spec(compile_engine(a.model, a.system, a.backend, tp_size=a.tp))
    except Exception as e:  # AIConfigurator raises its own types for unknown models, systems, versions
        raise SystemExit(f"aic_fit: AIConfigurator cannot build {a.model} on {a.system}/{a.backend} tp={a.tp}: {e}") from None

    tokens = np.unique(np.linspace(64, a.budget, 24).astype(int))
    prefill = np.array([engine.predict_prefill_latency(1, int(t), 0) for t in tokens])
    pa, pb, pc = fit_quadratic(tokens.astype(float), prefill)

    pool = a.kv_blocks * a.block_size
    us, decode = [], []
    for batch in (1, 4, 16, 32, 64, 128, 256):
        for ctx in (512, 2048, 8192, 32768):
            u = batch * ctx / pool
            if u <= 1.0:
                us.append(u)
                decode.append(engine.predict_decode_latency(batch, ctx, 2))
    u_arr, d_arr = np.array(us), np.array(decode)
    da, db, dc = fit_quadratic(u_arr, d_arr)
    fit = {
        "prefill_a": pa,
        "prefill_b": pb,
        "prefill_c": max(pc, 0.1),
        "decode_a": da,
        "decode_b": db,
        "decode_c": max(dc, 0.1),
        "decode_min_ms": max(0.1, float(d_arr.min()) * 0.5),
    }
    pred_p = pa * tokens**2 + pb * tokens + fit["prefill_c"]
    pred_d = np.maximum(da * u_arr**2 + db * u_arr + fit["decode_c"], fit["decode_min_ms"])
    print(f"{a.model} on {a.system} ({a.backend}, tp {a.tp}), AIConfigurator {getattr(aiconfigurator_core, '__version__', '0.12')}:")
    print(
        f"  prefill: {prefill[0]:.1f} ms at {tokens[0]} tokens .. {prefill[-1]:.1f} ms at {tokens[-1]}; fit off by at most {np.max(np.abs(pred_p / prefill - 1)) * 100:.1f}%"
    )
    print(
        f"  decode:  {d_arr.min():.1f} .. {d_arr.max():.1f} ms over {len(us)} (batch, context) points with u <= 1; "
        f"fit off by at most {np.max(np.abs(pred_d / d_arr - 1)) * 100:.1f}% (median {np.median(np.abs(pred_d / d_arr - 1)) * 100:.1f}%)"
    )
    text = json.dumps(fit, indent=1) + "\n"
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
        print(f"  wrote {a.out}: kvroute simulate --engine aisim --timing-fit {a.out} --kv-blocks {a.kv_blocks} ...")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
