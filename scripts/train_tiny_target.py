"""Train the built-in `tiny` target from scratch: a byte-level BPE tokenizer and a
Qwen3.5-style hybrid (Gated DeltaNet linear attention + gated full attention) causal LM,
both on the Python standard library's own `.py` files, which every machine has.

    python scripts/train_tiny_target.py --out flashdraft/assets/tiny --minutes 60

Files are split into train and held-out by a hash of their path, so the split is the
same on every machine.

A small model trained on this budget loops under greedy decoding (a line repeated to the
end). A second phase fixes that with sequence-level unlikelihood training (Welleck et al.
2019, "Neural Text Generation with Unlikelihood Training"): the model continues random
training windows greedily, and every token that completes a 4-gram already seen in its
own continuation is pushed down with -log(1 - p), next to the usual next-token loss:

    python scripts/train_tiny_target.py --continue-from flashdraft/assets/tiny \
        --out flashdraft/assets/tiny --minutes 30 --unlikelihood --lr 5e-4
 The weights are written in bf16 (the committed copy must stay
under 20 MB); flashdraft loads them in fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from flashdraft.data.stdlib import stdlib_files  # the split that builtin:stdlib prompts share

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|mask|>"]


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read(p) for p in files), trainer=trainer)
    return tok


def encode_corpus(tok: Tokenizer, files: list[Path]) -> torch.Tensor:
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch([read(p) for p in files]):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int16 if tok.get_vocab_size() < 32768 else torch.int32)


def model_config(vocab_size: int, args: argparse.Namespace) -> dict:
    pattern = ["linear_attention"] * (args.linear_per_full) + ["full_attention"]
    layer_types = (pattern * math.ceil(args.layers / len(pattern)))[: args.layers]
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 3,
        "num_hidden_layers": args.layers,
        "layer_types": layer_types,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 128),
        "head_dim": 64,
        "linear_num_key_heads": args.hidden // 64,
        "linear_num_value_heads": args.hidden // 64,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": 1,
        "dtype": "bfloat16",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("flashdraft/assets/tiny"))
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--linear-per-full", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bench", action="store_true", help="time 5 steps and exit")
    ap.add_argument(
        "--unlikelihood",
        action="store_true",
        help="add sequence-level unlikelihood on the model's own greedy continuations (anti-looping)",
    )
    ap.add_argument("--ul-prefix", type=int, default=32, help="prefix tokens of each unlikelihood window")
    ap.add_argument("--ul-continuation", type=int, default=96, help="greedy tokens generated per window")
    ap.add_argument("--ul-batch-size", type=int, default=8)
    ap.add_argument(
        "--continue-from",
        type=Path,
        default=None,
        help="continue training the model (and reuse the tokenizer) saved in this directory",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    args.out.mkdir(parents=True, exist_ok=True)
    train_files, held_files = stdlib_files()
    print(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files", flush=True)
    tok_path = args.out / "tokenizer.json"
    if args.continue_from is not None:
        tok = Tokenizer.from_file(str(args.continue_from / "tokenizer.json"))
    elif tok_path.exists() and args.bench:
        tok = Tokenizer.from_file(str(tok_path))
    else:
        tok = train_tokenizer(train_files, args.vocab_size)
    train_ids = encode_corpus(tok, train_files).long()
    held_ids = encode_corpus(tok, held_files).long()
    print(f"tokens: train {len(train_ids):,}, held-out {len(held_ids):,}", flush=True)

    if args.continue_from is not None:
        model = Qwen3_5ForCausalLM.from_pretrained(args.continue_from, dtype=torch.float32)
        cfg = model.config
        previous = json.loads((args.continue_from / "training.json").read_text())
    else:
        cfg = Qwen3_5TextConfig(**model_config(tok.get_vocab_size(), args))
        model = Qwen3_5ForCausalLM(cfg).float()
        previous = {"steps": 0, "minutes": 0.0, "train_tokens_seen": 0}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters, layer types {cfg.layer_types}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes * 60
    warmup = 20 if args.continue_from is not None else 100  # a trained model needs little warm-up

    def batch(ids: torch.Tensor, gen: random.Random) -> torch.Tensor:
        starts = [gen.randrange(0, len(ids) - args.seq_len - 1) for _ in range(args.batch_size)]
        return torch.stack([ids[s : s + args.seq_len + 1] for s in starts])

    @torch.no_grad()
    def held_out_loss(n_batches: int = 20) -> float:
        model.eval()
        gen = random.Random(1234)
        losses = [
            model(input_ids=batch(held_ids, gen)).loss if False else _loss(batch(held_ids, gen))
            for _ in range(n_batches)
        ]
        model.train()
        return float(torch.stack(losses).mean())

    def _loss(x: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=x[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    @torch.no_grad()
    def greedy_windows(gen: random.Random) -> torch.Tensor:
        """[ul_batch, prefix + continuation]: train-window prefixes continued greedily."""
        starts = [gen.randrange(0, len(train_ids) - args.ul_prefix) for _ in range(args.ul_batch_size)]
        prefix = torch.stack([train_ids[s : s + args.ul_prefix] for s in starts])
        model.eval()
        out = model.generate(
            prefix,
            attention_mask=torch.ones_like(prefix),
            max_new_tokens=args.ul_continuation,
            min_new_tokens=args.ul_continuation,  # no early stop: every row has the same length
            do_sample=False,
        )
        model.train()
        return out

    def repeated_4gram_mask(seqs: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: continuation tokens that complete a 4-gram seen earlier in the continuation."""
        mask = torch.zeros_like(seqs, dtype=torch.bool)
        for b, row in enumerate(seqs.tolist()):
            seen: set[tuple[int, ...]] = set()
            for t in range(args.ul_prefix + 3, len(row)):
                gram = tuple(row[t - 3 : t + 1])
                if gram in seen:
                    mask[b, t - 3 : t + 1] = True  # the whole repeated 4-gram, as in the paper
                seen.add(gram)
        mask[:, : args.ul_prefix] = False
        return mask

    def unlikelihood_loss(seqs: torch.Tensor) -> tuple[torch.Tensor, float]:
        penalised = repeated_4gram_mask(seqs)[:, 1:]  # [B, T-1], aligned with the predicted tokens
        logits = model(input_ids=seqs[:, :-1]).logits
        p_token = logits.float().softmax(-1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
        ul = -torch.log((1 - p_token).clamp_min(1e-5))
        n_continuation = seqs.shape[0] * args.ul_continuation
        repeated_share = float(penalised.sum()) / n_continuation
        return (ul * penalised).sum() / n_continuation, repeated_share

    gen = random.Random(args.seed)
    start = time.time()
    step = 0
    model.train()
    while True:
        elapsed = time.time() - start
        if elapsed > budget or (args.bench and step == 5):
            break
        # lr: linear warm-up, then cosine decay over the time budget (not steps: CPU speed varies)
        frac = min(1.0, elapsed / budget)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = _loss(batch(train_ids, gen))
        if args.unlikelihood:
            ul, repeated_share = unlikelihood_loss(greedy_windows(gen))
            loss = loss + ul
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or args.bench:
            tps = step * args.batch_size * args.seq_len / (time.time() - start)
            print(f"step {step} loss {loss.item():.3f} lr {lr:.2e} {tps:.0f} tok/s {elapsed / 60:.1f} min", flush=True)
        if args.unlikelihood and (step % 10 == 0 or args.bench):
            print(f"step {step} unlikelihood {ul.item():.3f} repeated share {repeated_share:.2f}", flush=True)
        if step % (50 if args.unlikelihood else 500) == 0:
            print(f"step {step} held-out loss {held_out_loss():.3f}", flush=True)
    if args.bench:
        return
    final = held_out_loss(50)
    print(f"final: {step} steps, held-out loss {final:.3f} nats", flush=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tok.save(str(tok_path))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        mask_token="<|mask|>",
    )
    hf_tok.save_pretrained(args.out)
    (args.out / "training.json").write_text(
        json.dumps(
            {
                "steps": previous["steps"] + step,
                "minutes": previous["minutes"] + args.minutes,
                "held_out_loss": final,
                "parameters": n_params,
                "train_tokens_seen": previous["train_tokens_seen"] + step * args.batch_size * args.seq_len,
                "phases": previous.get("phases", [])
                + [
                    {
                        "minutes": args.minutes,
                        "lr": args.lr,
                        "steps": step,
                        "threads": args.threads,
                        "unlikelihood": args.unlikelihood,
                        "held_out_loss": final,
                    }
                ],
                "args": {k: str(v) for k, v in vars(args).items()},
                "python": sys.version,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
