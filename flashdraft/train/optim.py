"""Optimizers and the learning-rate schedule: AdamW for every parameter (the recipe), or Muon
for the matrix weights of the decoder layers and `fc` with AdamW for the rest (norms, an own
LM head), as vLLM speculators' DFlash defaults do. Each optimizer gets the same warm-up +
cosine schedule; they step, save and resume together. Under FSDP2 Muon orthogonalises whole
matrices (`WholeMatrixMuon`) and checkpoints hold the whole (gathered) optimizer state."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim._muon import _adjust_lr  # torch's lr scaling

from flashdraft.errors import FlashdraftError
from flashdraft.train.config import TrainConfig

OPTIMIZERS = ("adamw", "muon")


def warmup_steps(total_steps: int, warmup_fraction: float) -> int:
    """The steps of the schedule's linear warm-up (at least one)."""
    return max(1, int(round(total_steps * warmup_fraction)))


def lr_lambda(total_steps: int, warmup_fraction: float, min_lr_fraction: float = 0.0):
    """Linear warm-up then cosine decay to min_lr_fraction (multiplier of the base lr)."""
    warmup = warmup_steps(total_steps, warmup_fraction)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_lr_fraction + (1 - min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def is_muon_parameter(name: str, param: torch.Tensor) -> bool:
    """Muon's share: the 2-D weights of the decoder layers and fc (not norms, not an LM head)."""
    name = name.removeprefix("module.").removeprefix("_orig_mod.")
    return param.ndim == 2 and (name.startswith("layers.") or name == "fc.weight")


class WholeMatrixMuon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz step sees each whole matrix under FSDP2 (a sharded (DTensor) update is
    gathered, orthogonalised on every rank exactly as one process does it, and each rank keeps its rows), and runs
    in `ns_dtype`: None picks bfloat16 on accelerators (torch's and the reference's numerics) and float32 on a
    CPU, where bfloat16 matrix products without hardware support took 11x as long (a 768 x 256 update: 318 ms
    against 28 ms, x86_64 without AVX-512, one thread), which made a Muon step 11x an AdamW one."""

    def __init__(self, params, *args, ns_dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor, distribute_tensor  # here: a second of import for every command

        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            for param, grad, buffer in zip(params, grads, buffers, strict=True):
                buffer.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
                sharded = isinstance(update, DTensor)
                whole = update.full_tensor() if sharded else update  # [out, in] on every rank
                dtype = self.ns_dtype or (torch.float32 if whole.device.type == "cpu" else torch.bfloat16)
                ortho = newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                if sharded:
                    ortho = distribute_tensor(ortho, param.device_mesh, param.placements, src_data_rank=None)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(ortho, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], param.shape))
        return None


def newton_schulz(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalisation of a matrix [out, in], the same operations in
    `dtype` (torch fixes bfloat16)."""
    a, b, c = coefficients
    x = update.to(dtype)
    if update.size(0) > update.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if update.size(0) > update.size(1) else x


class Optimizers:
    """One or two optimizers, each with its own scheduler, used as one. `sharded_model`: the
    FSDP2 model whose optimizer state is sharded; its checkpoints then hold the whole state,
    keyed by parameter name (every rank takes part in saving and loading it)."""

    def __init__(
        self,
        pairs: list[tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]],
        sharded_model: nn.Module | None = None,
    ) -> None:
        self.pairs = pairs
        self.sharded_model = sharded_model

    def step(self) -> None:
        for optimizer, scheduler in self.pairs:
            optimizer.step()
            scheduler.step()

    def zero_grad(self) -> None:
        for optimizer, _ in self.pairs:
            optimizer.zero_grad(set_to_none=True)

    def last_lr(self) -> float:
        """The lr of the first optimizer (AdamW's; Muon's follows the same schedule)."""
        return self.pairs[0][1].get_last_lr()[0]

    def state_dict(self) -> dict:
        """The state resume needs (a collective under FSDP: every rank calls it)."""
        if self.sharded_model is None:
            optimizers = [o.state_dict() for o, _ in self.pairs]
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optimizers = [get_optimizer_state_dict(self.sharded_model, o, options=whole) for o, _ in self.pairs]
        return {"optimizers": optimizers, "schedulers": [s.state_dict() for _, s in self.pairs]}

    def load_state_dict(self, state: dict, source: str) -> None:
        saved = len(state.get("optimizers", []))
        if saved != len(self.pairs):
            raise FlashdraftError(
                f"{source}: saved with {saved} optimizer(s); this run has {len(self.pairs)} (resume with the same "
                f"--optimizer)"
            )
        for (optimizer, scheduler), o, s in zip(self.pairs, state["optimizers"], state["schedulers"], strict=True):
            if self.sharded_model is None:
                optimizer.load_state_dict(o)
            else:  # each rank keeps its shard of the whole state
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                whole = StateDictOptions(full_state_dict=True)
                set_optimizer_state_dict(self.sharded_model, optimizer, o, options=whole)
            scheduler.load_state_dict(s)


def build_optimizers(model: nn.Module, cfg: TrainConfig, total_steps: int) -> Optimizers:
    """The run's optimizer (`cfg.optimizer`) over `total_steps` of warm-up and decay: AdamW over every trainable
    parameter, or Muon (matrix weights, `muon_lr`, default `lr`: Muon's update is scaled to AdamW's RMS, so one lr
    serves both) + AdamW (the rest, `lr`)."""
    name, lr, muon_lr, weight_decay = cfg.optimizer, cfg.lr, cfg.muon_lr, cfg.weight_decay
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    schedule = lr_lambda(total_steps, cfg.warmup_fraction, cfg.min_lr_fraction)

    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    if name == "adamw":
        groups = [adamw([p for _, p in named])]
    elif name == "muon":
        matrices = [p for n, p in named if is_muon_parameter(n, p)]
        rest = [p for n, p in named if not is_muon_parameter(n, p)]
        muon = WholeMatrixMuon(
            matrices,
            lr=muon_lr if muon_lr is not None else lr,
            weight_decay=weight_decay,
            adjust_lr_fn="match_rms_adamw",
        )
        groups = [adamw(rest), muon]
    else:
        raise FlashdraftError(f"--optimizer {name}: expected one of {', '.join(OPTIMIZERS)}")
    sharded = model if cfg.fsdp and torch.distributed.is_initialized() else None
    return Optimizers([(o, torch.optim.lr_scheduler.LambdaLR(o, schedule)) for o in groups], sharded)
