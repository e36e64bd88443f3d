"""Static decoding state for the target: every buffer allocated once, every verify the same shapes, so the verify can be
compiled once (`torch.compile(fullgraph=True, dynamic=False)`; on CUDA as a CUDA graph) and never recompiled.

The eager path (`TargetModel.forward` on a `DynamicCache`, `TargetModel.rollback`) grows caches with `torch.cat` and
rolls back by cropping and recomputing: new shapes every step. Here, as gpt-fast, vLLM and SGLang do it:

- attention, sliding-window and MLA layers (`PositionedKVLayer`) keep K/V (MLA: its latents) in buffers
  [B, heads, capacity, dim] written with `index_copy_` at the positions of the forward's tokens, read from the
  device position `StaticTargetCache.position`. Rollback is that position: it advances by the committed tokens only;
  a rejected draft's rows stay in the buffer, masked (a query at position p sees keys at positions <= p, and a
  sliding layer's those within its window), and the next verify overwrites them.
- Mamba-2 layers (`RecurrentSlots`) keep the state after each of the verify's T tokens (T slots), and so do Gated
  DeltaNet layers in a draft tree's verify (a node's slot; `decoding.static_tree`); in a chain's verify Gated DeltaNet
  layers (`DeltaRuleSlots`) keep what those T states are made of (the state before the block, the block's keys,
  solved values and cumulative decay), from which the next verify computes the one it starts from. Both keep the conv
  inputs of the verify's window (the K cached before the block, then its T). Commit writes the accepted count `a`
  into the device tensor `StaticTargetCache.slot`; the next verify starts from slot a's state and from conv columns
  a + 1 .. a + K (the K inputs ending at the last kept token): nothing is copied on the host, nothing re-run.
- the verify is always T = `verify_length` tokens (the anchor, the drafts, a padded tail): its padded rows write K/V
  past the committed tokens (masked, overwritten later) and states (or their terms) no commit selects.

The prompt is prefilled on the eager path (any length, not compiled) and its caches copied in (`seed`); the
verify (`StaticVerifier.verify`) is then one function of fixed shapes with every buffer at a fixed address.
transformers' `StaticLayer` is not used: it advances a counter of its own on every write, so a rollback would have
to reset one counter per layer, and its sliding variant is a ring of window size whose rejected rows would have
overwritten keys a rollback still needs; its `StaticCache` has no state per verified token for recurrent layers.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from flashdraft.errors import FlashdraftError
from flashdraft.target.linear_attention import (
    TreeNodes,
    _heads,
    _output,
    causal_conv_window,
    gated_delta_net_projections,
    gated_delta_rule_block,
    tree_recurrence,
)
from flashdraft.target.mamba import is_mamba
from flashdraft.target.model import TargetModel, TargetOutput

# layer kinds with a static rule; chunked attention (Llama 4's: a key is seen within its query's chunk) has no mask here
STATIC_KINDS = ("attention", "sliding", "mla", "gated_deltanet", "mamba2", "mlp")
CAPACITY_STEP = 256  # buffers are sized in steps of this many positions, so prompts of near lengths share a graph


def with_own_code(method):
    """A bound method whose function has a code object of its own. Dynamo keeps compiled graphs per code object, at
    most `recompile_limit` (8) of them: every instance of a class compiling its method would share one code object,
    and the ninth verifier (or drafting state) in a process would fail to compile (`fullgraph=True` raises
    `FailOnRecompileLimitHit`). With its own code, each instance's graphs are its own."""
    fn = method.__func__
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(fresh, method.__self__)


def compile_step(function, backend: str, mode: str | None):
    """`function` under `torch.compile(fullgraph=True, dynamic=False)` with `backend` and `mode` (None: the default;
    "reduce-overhead": CUDA graphs), its own code object (`with_own_code`) and no guards on the modules it reads.

    Dynamo checks a graph's guards on every call, and most of a decoding graph's are on the attributes of the target's
    (or drafter's) modules: ~2,800 guard checks on the tiny target, ~12 % of a compiled 1-token step on a CPU.
    A decoding graph is made for one model in one dtype on one device (`static_verifier` and `static_state` key their
    states on them) and a decoding loop changes none of its modules, so those guards are dropped
    (`torch.compiler.skip_guard_on_all_nn_modules_unsafe`); the guards on the inputs' shapes, dtypes and devices, the
    grad mode and the rest stay. A module changed in place between steps (a layer swapped for another kind, a hook
    added) is therefore not seen: build a new verifier (or drafting state) after changing the model."""
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if mode is not None and backend == "inductor":  # torch.compile takes a mode or options: the mode's options then
        from torch._inductor import list_mode_options

        options |= list_mode_options(mode)
        mode = None
    return torch.compile(
        with_own_code(function), backend=backend, fullgraph=True, dynamic=False, mode=mode, options=options
    )


def _static_address(tensor: torch.Tensor) -> torch.Tensor:
    """Tell dynamo the tensor keeps its address: a compiled graph (a CUDA graph) reads and writes it in place."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor


class PositionedKVLayer(CacheLayerMixin):
    """K/V (or MLA latents) of one attention layer in [B, heads, capacity, dim] buffers, written at the cache's
    `write_positions` [T] (a device tensor the verify fills); every update returns the whole buffers, and the
    verify's mask hides the positions past each query's own."""

    is_compileable = True
    is_sliding = False

    def __init__(self, capacity: int, write_positions: torch.Tensor) -> None:
        super().__init__()
        self.capacity, self.write_positions = capacity, write_positions

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        self.keys = _static_address(key_states.new_zeros(batch, heads, self.capacity, key_states.shape[-1]))
        self.values = _static_address(value_states.new_zeros(batch, heads, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.write_positions, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.write_positions, value_states.to(self.values.dtype))
        return self.keys, self.values

    def seed(self, keys: torch.Tensor, values: torch.Tensor, end: int) -> None:
        """The eager cache's last keys [B, h, n, d] and values, at positions end - n .. end - 1."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        n = keys.shape[-2]
        self.keys[:, :, end - n : end].copy_(keys)
        self.values[:, :, end - n : end].copy_(values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def get_seq_length(self) -> int:  # the position is on the device; verify passes positions, never asks
        return 0

    def get_max_length(self) -> int:
        return self.capacity


@dataclass
class RecurrentSlots:
    """One Mamba-2 layer's state after each of the verify's T tokens (`states` [T, B, *state]) and the conv inputs of
    its window (`window` [B, C, K + T]: the K before the block, then the block's T)."""

    states: torch.Tensor
    window: torch.Tensor

    @classmethod
    def like(cls, conv_state: torch.Tensor, recurrent_state: torch.Tensor, verify_length: int) -> RecurrentSlots:
        states = recurrent_state.new_zeros(verify_length, *recurrent_state.shape)
        window = conv_state.new_zeros(*conv_state.shape[:-1], conv_state.shape[-1] + verify_length)
        return cls(_static_address(states), _static_address(window))

    def buffers(self) -> list[torch.Tensor]:
        return [self.states, self.window]

    def seed(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        """The prefill's states as slot 0 (the commit after seeding selects slot 0)."""
        kernel = conv_state.shape[-1]
        self.states[0].copy_(recurrent_state)
        self.window[..., 1 : 1 + kernel].copy_(conv_state)

    def conv_before(self, slot: torch.Tensor, kernel: int) -> torch.Tensor:
        """The conv inputs [B, C, K] ending at the kept token: the K before the next block."""
        columns = slot + 1 + torch.arange(kernel, device=slot.device)  # [K]
        return self.window.index_select(-1, columns)

    def start(self, slot: torch.Tensor, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv inputs [B, C, K] before the block, state [B, *state]) the committed slot leaves."""
        return self.conv_before(slot, kernel), self.states.index_select(0, slot.view(1))[0]


@dataclass
class DeltaRuleSlots(RecurrentSlots):
    """One Gated DeltaNet layer's last verify, kept as what its state after any of the T tokens is made of rather
    than as T states: the state before the block (`initial` [B, H, dk, dv]), the block's keys (`key` [B, H, T, dk]),
    solved values (`v_new` [B, H, T, dv]) and cumulative log decay (`cum` [B, H, T]), and the conv window as
    `RecurrentSlots`. The state after token a is S_0 e^cum_a + sum_{j <= a} e^(cum_a - cum_j) k_j^T v_new_j
    (`linear_attention.state_after`), which the next verify computes for the committed slot alone: one [dk, T] x
    [T, dv] product a head, where keeping every slot cost a [dk, T] x [T, dv] product per slot and a write of T states
    (on the tiny target's 17-token verify, a fifth of the compiled verify on a CPU)."""

    key: torch.Tensor = None
    v_new: torch.Tensor = None
    cum: torch.Tensor = None

    @classmethod
    def like(cls, conv_state: torch.Tensor, recurrent_state: torch.Tensor, verify_length: int) -> DeltaRuleSlots:
        batch, heads, dk, dv = recurrent_state.shape
        window = conv_state.new_zeros(*conv_state.shape[:-1], conv_state.shape[-1] + verify_length)
        fp32 = dict(dtype=torch.float32, device=recurrent_state.device)
        return cls(
            states=_static_address(recurrent_state.new_zeros(recurrent_state.shape)),  # the initial state
            window=_static_address(window),
            key=_static_address(torch.zeros(batch, heads, verify_length, dk, **fp32)),
            v_new=_static_address(torch.zeros(batch, heads, verify_length, dv, **fp32)),
            cum=_static_address(torch.zeros(batch, heads, verify_length, **fp32)),
        )

    def buffers(self) -> list[torch.Tensor]:
        return [self.states, self.window, self.key, self.v_new, self.cum]

    def seed(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        """The prefill's states as every slot: a block of zero keys and values that does not decay."""
        kernel = conv_state.shape[-1]
        self.states.copy_(recurrent_state)
        for tensor in (self.key, self.v_new, self.cum):
            tensor.zero_()
        self.window[..., 1 : 1 + kernel].copy_(conv_state)

    def start(self, slot: torch.Tensor, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv inputs [B, C, K] before the next block, fp32 state [B, H, dk, dv] after the block's token `slot`)."""
        cum_kept = self.cum.index_select(-1, slot.view(1))  # [B, H, 1]
        later = torch.arange(self.cum.shape[-1], device=slot.device) > slot  # [T]: tokens past the kept one
        weight = (cum_kept - self.cum).masked_fill(later, float("-inf")).exp()  # [B, H, T]: 0 past the kept token
        state = self.states.float() * cum_kept.exp()[..., None] + (self.key * weight[..., None]).transpose(-1, -2) @ (
            self.v_new
        )
        return self.conv_before(slot, kernel), state

    def keep(self, initial: torch.Tensor, key: torch.Tensor, v_new: torch.Tensor, cum: torch.Tensor, window) -> None:
        """Record a verify: its initial state [B, H, dk, dv], keys, solved values, cumulative decay, conv window."""
        self.states.copy_(initial)
        self.key.copy_(key)
        self.v_new.copy_(v_new)
        self.cum.copy_(cum)
        self.window.copy_(window)


class StaticTargetCache(Cache):
    """The target's fixed-shape decoding state: one `PositionedKVLayer` per attention layer, one `RecurrentSlots` per
    recurrent layer (layers without a cache get neither), the committed length `position` and the accepted count
    `slot` of the last step ([] int64 on the device), and the positions a verify writes (`write_positions` [T])."""

    def __init__(self, target: TargetModel, capacity: int, verify_length: int) -> None:
        device = target.device
        self.capacity, self.verify_length = capacity, verify_length
        self.position = _static_address(torch.zeros((), dtype=torch.long, device=device))
        self.slot = _static_address(torch.zeros((), dtype=torch.long, device=device))
        self.write_positions = _static_address(torch.zeros(verify_length, dtype=torch.long, device=device))
        self.kinds = target.support.layer_kinds
        self.recurrent: dict[int, RecurrentSlots] = {}
        # a draft tree's verify (`flashdraft.decoding.static_tree`): the nodes' parents and depths [T] in fixed buffers
        # and the depth bound; None: the verify is a chain
        self.tree: TreeNodes | None = None
        layers = [
            PositionedKVLayer(capacity, self.write_positions) if kind not in ("gated_deltanet", "mamba2") else None
            for kind in self.kinds
        ]
        super().__init__(layers=layers)

    @property
    def is_compileable(self) -> bool:
        return True

    def seed(self, target: TargetModel, eager_cache, length: int) -> None:
        """Copy a prefilled eager cache (`TargetModel.new_cache` after a forward over `length` tokens) in, and set the
        position to `length` (outside any graph: the first copy allocates the buffers)."""
        for i, kind in enumerate(self.kinds):
            source = eager_cache.kv.layers[i] if i < len(eager_cache.kv.layers) else None
            if kind in ("gated_deltanet", "mamba2"):
                conv, recurrent = source.conv_states[0], source.recurrent_states[0]
                if i not in self.recurrent:
                    # a chain's Gated DeltaNet keeps the block's terms; a tree's nodes each their state (its commit
                    # reorders the slots), as Mamba-2 does
                    slots = DeltaRuleSlots if kind == "gated_deltanet" and self.tree is None else RecurrentSlots
                    self.recurrent[i] = slots.like(conv, recurrent, self.verify_length)
                self.recurrent[i].seed(conv, recurrent)
            elif kind != "mlp" and getattr(source, "keys", None) is not None and source.keys.numel():
                self.layers[i].seed(source.keys, source.values, length)
        self.position.fill_(length)
        self.slot.zero_()

    def commit(self, accepted: int | torch.Tensor) -> None:
        """Keep the anchor and `accepted` drafts of the last verify: the position advances past them and the recurrent
        layers' next verify starts from slot `accepted`. A device tensor [] stays on the device."""
        if isinstance(accepted, torch.Tensor):
            self.slot.copy_(accepted)
            self.position.add_(accepted + 1)
        else:
            self.slot.fill_(accepted)
            self.position.add_(accepted + 1)


# -- recurrent layers over a fixed block, keeping the state after any of its tokens ---------------------------------


def gated_deltanet_static_forward(layer: nn.Module, hidden_states: torch.Tensor, cache: StaticTargetCache):
    """A Gated DeltaNet layer (Qwen3.5/3.6's, Qwen3-Next's) over the verify's T tokens: hidden_states [B, T, hidden]
    -> [B, T, hidden], from the committed slot's state; keeps what the state after each token is made of (the state
    before the block, keys, solved values, cumulative decay: `DeltaRuleSlots`) and the block's conv window."""
    slots, kernel = cache.recurrent[layer.layer_idx], layer.conv_kernel_size
    mixed_qkv, z, b, a = gated_delta_net_projections(layer, hidden_states)
    before, state = slots.start(cache.slot, kernel)
    window = torch.cat([before, mixed_qkv.transpose(1, 2).to(before.dtype)], -1)  # [B, C, K + T]
    conv_out = causal_conv_window(window[..., 1:], layer.conv1d.weight[:, 0])  # [B, C, T]
    query, key, value, g, beta = _heads(layer, conv_out, b, a)
    out, _, v_new, cum = gated_delta_rule_block(query, key, value, g, beta, state)
    slots.keep(state, key, v_new, cum, window)
    return _output(layer, out, z, hidden_states)


def gated_deltanet_tree_static_forward(layer: nn.Module, hidden_states: torch.Tensor, cache: StaticTargetCache):
    """A Gated DeltaNet layer over a draft tree's T nodes (`cache.tree`): hidden_states [B, T, hidden] -> [B, T,
    hidden], each node along its own root path from the committed slot (`linear_attention.tree_recurrence`, as the
    eager tree forward); writes the state after each node into its slot and the nodes' conv inputs after the K
    before them (the tree's commit moves the accepted path's to the front)."""
    slots, kernel = cache.recurrent[layer.layer_idx], layer.conv_kernel_size
    mixed_qkv, z, b, a = gated_delta_net_projections(layer, hidden_states)
    before, state = slots.start(cache.slot, kernel)
    window = torch.cat([before, mixed_qkv.transpose(1, 2).to(before.dtype)], -1)  # [B, C, K + T]
    out, states = tree_recurrence(layer, window, b, a, state.float(), cache.tree)  # states [B, H, T, dk, dv]
    slots.states.copy_(states.permute(2, 0, 1, 3, 4))
    slots.window.copy_(window)
    return _output(layer, out, z, hidden_states)


def mamba2_static_forward(layer: nn.Module, hidden_states: torch.Tensor, cache: StaticTargetCache):
    """A Mamba-2 mixer (Nemotron-H's) over the verify's T tokens, token by token as its recurrence (T is a handful,
    unrolled in the graph): hidden_states [B, T, hidden] -> [B, T, hidden]; writes the SSM state after each token
    and the block's conv window. dt is clamped to the mixer's `time_step_limit` as its chunked scan does."""
    slots, kernel = cache.recurrent[layer.layer_idx], layer.conv_kernel_size
    batch, length, _ = hidden_states.shape
    heads, head_dim, groups, size = layer.num_heads, layer.head_dim, layer.n_groups, layer.ssm_state_size
    gate, x_b_c, dt = layer.in_proj(hidden_states).split([layer.intermediate_size, layer.conv_dim, heads], -1)
    before, state = slots.start(cache.slot, kernel)
    window = torch.cat([before, x_b_c.transpose(1, 2).to(before.dtype)], -1)  # [B, C, K + T]
    conv_out = causal_conv_window(window[..., 1:], layer.conv1d.weight[:, 0])  # [B, C, T]
    if layer.conv1d.bias is not None:
        conv_out = conv_out + layer.conv1d.bias[:, None]
    x, b, c = layer.act(conv_out).transpose(1, 2).split([layer.intermediate_size, groups * size, groups * size], -1)
    x = x.reshape(batch, length, heads, head_dim).float()
    b = b.reshape(batch, length, groups, size).repeat_interleave(heads // groups, dim=2).float()  # [B, T, H, N]
    c = c.reshape(batch, length, groups, size).repeat_interleave(heads // groups, dim=2).float()
    dt = F.softplus(dt.float() + layer.dt_bias.float())  # [B, T, H]
    low, high = layer.time_step_limit
    dt = dt.clamp(min=low) if high == float("inf") else dt.clamp(min=low, max=high)
    decay = (dt * -layer.A_log.float().exp()).exp()  # [B, T, H]
    state, states, outs = state.float(), [], []
    for t in range(length):
        state = state * decay[:, t, :, None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None]
        states.append(state)
        outs.append((state @ c[:, t, :, :, None])[..., 0] + x[:, t] * layer.D.float()[:, None])  # [B, H, hd]
    slots.states.copy_(torch.stack(states))
    slots.window.copy_(window)
    scan = torch.stack(outs, 1).reshape(batch, length, -1)  # [B, T, H * hd]
    return layer.out_proj(layer.norm(scan.to(hidden_states.dtype), gate).to(hidden_states.dtype))


def install_static_path(mixer: nn.Module) -> None:
    """Route a recurrent mixer's forwards on a `StaticTargetCache` to its static forward; every other call keeps the
    forward it had (transformers', or flashdraft's short-block path). Once per mixer."""
    if getattr(mixer, "_static_path", False):
        return
    previous = mixer.forward
    static = mamba2_static_forward if is_mamba(mixer) else gated_deltanet_static_forward

    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if isinstance(cache_params, StaticTargetCache):
            if cache_params.tree is not None:  # a draft tree: Gated DeltaNet only (the tree loop refuses Mamba-2)
                return gated_deltanet_tree_static_forward(mixer, hidden_states, cache_params)
            return static(mixer, hidden_states, cache_params)
        return previous(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)

    mixer.forward = forward
    mixer._static_path = True


# -- the verify -----------------------------------------------------------------------------------------------------


def static_support(target: TargetModel) -> str | None:
    """Why the target cannot decode on a static cache, or None: every layer kind must have a static rule. The
    recurrent layers' static forwards are plain torch whatever backend their eager path runs (fla's, mamba-ssm's):
    under a CUDA graph their launches cost nothing more, and a per-token state is what those kernels do not give."""
    if target.vision is not None:  # after an image M-RoPE's text positions trail the token index; the verify has one
        return "a vision-language target (M-RoPE positions after an image are not carried by the static verify)"
    other = [kind for kind in target.support.kinds if kind not in STATIC_KINDS]
    if other:
        return f"layer kinds {other} have no static cache (only {', '.join(STATIC_KINDS)})"
    activation = {getattr(target.linear_mixers[i], "activation", "silu") for i in target.linear_layers}
    if activation - {"silu"}:
        return f"recurrent mixers with conv activation {sorted(activation)} (the static forward applies SiLU)"
    return None


def capacity_for(tokens: int) -> int:
    """Buffer positions for `tokens` (prompt, new tokens, a padded verify), rounded up to `CAPACITY_STEP`."""
    return -(-tokens // CAPACITY_STEP) * CAPACITY_STEP


@dataclass
class CompileCounts:
    """What torch.compile did for a verifier: graphs compiled (the first is the warm-up; each later one a recompile),
    graph breaks, and the seconds spent compiling (the calls that compiled, wall time)."""

    compiles: int = 0
    recompiles: int = 0
    graph_breaks: int = 0
    compile_seconds: float = 0.0

    after_warm_up: int = 0  # graphs compiled by the generations `add`ed (an evaluation's records after its warm-up)

    def add(self, result) -> None:
        """Count a generation's (a `GenerationResult`) in."""
        self.compiles += result.compiles
        self.recompiles += result.recompiles
        self.graph_breaks += result.graph_breaks
        self.compile_seconds += result.compile_seconds
        self.after_warm_up += result.compiles

    def as_dict(self) -> dict:
        return {
            "compiles": self.compiles,
            "recompiles": self.recompiles,
            "graph_breaks": self.graph_breaks,
            "compile_seconds": round(self.compile_seconds, 3),
        }


def dynamo_totals() -> tuple[int, int]:
    """(graphs compiled, graph breaks) by dynamo in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values())


@dataclass
class StaticVerifier:
    """The target's verify over a fixed `verify_length` on a `StaticTargetCache` of `capacity` positions, compiled
    with `backend` (None: run as written, the static path without compiling; "inductor": on CUDA as CUDA graphs,
    mode "reduce-overhead"; "eager" / "aot_eager": dynamo's tracing alone, what tests use)."""

    target: TargetModel
    verify_length: int
    capacity: int
    backend: str | None = "inductor"
    cache: StaticTargetCache = field(init=False)
    counts: CompileCounts = field(default_factory=CompileCounts)

    def __post_init__(self) -> None:
        reason = static_support(self.target)
        if reason is not None:
            raise FlashdraftError(f"{self.target.path or 'the target'}: static decoding refused: {reason}")
        for mixer in self.target.linear_mixers.values():
            install_static_path(mixer)
        self.cache = StaticTargetCache(self.target, self.capacity, self.verify_length)
        device = self.target.device
        self._offsets = torch.arange(self.verify_length, device=device)  # [T]
        self._key_positions = torch.arange(self.capacity, device=device)  # [L]
        self._window = getattr(self.target.config, "sliding_window", None)
        self._step = self._forward
        self._mode = "reduce-overhead" if device.type == "cuda" and self.backend == "inductor" else None
        if self.backend is not None:
            self._step = compile_step(self._forward, self.backend, self._mode)

    def _masks(self, positions: torch.Tensor):
        """The additive masks [1, 1, T, L] of the verify's queries at `positions` [T]: keys at positions up to the
        query's own (rows past it hold rejected drafts or nothing yet), within the window on sliding layers."""
        seen = self._key_positions[None, :] <= positions[:, None]  # [T, L]
        sliding = None
        if self._window and "sliding_attention" in self.target.layer_types:
            sliding = seen & (positions[:, None] - self._key_positions[None, :] < self._window)
        return self.additive(seen, sliding)

    def additive(self, full: torch.Tensor, sliding: torch.Tensor | None):
        """What the decoder takes for the boolean masks (True: seen) of its full and sliding layers ([T, L], or [B,
        T, L] per row): additive masks [1 or B, 1, T, L], a dict by layer kind where the target has sliding or
        recurrent layers (those take none), else the one mask."""
        dtype = self.target.dtype
        masks = {"full_attention": full} | ({"sliding_attention": sliding} if sliding is not None else {})
        additive = {}
        for kind, mask in masks.items():
            mask = mask[None] if mask.dim() == 2 else mask  # [B, T, L]
            zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            additive[kind] = zeros.masked_fill(~mask, torch.finfo(dtype).min)[:, None]
        if self.target.linear_layers:  # recurrent layers take no mask
            additive["linear_attention"] = None
        return additive if len(additive) > 1 else additive["full_attention"]

    def _forward(self, input_ids: torch.Tensor):
        """input_ids [1, T] -> (logits [1, T, V], hidden [1, T, H], features [1, T, n * H] or None)."""
        positions = self.cache.position + self._offsets  # [T]
        self.cache.write_positions.copy_(positions)
        return self._decode(input_ids, positions, self._masks(positions))

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, masks):
        """The decoder over input_ids [B, T] at rotary `positions` [T] under `masks` (written at the cache's
        `write_positions`) -> (logits [B, T, V], hidden [B, T, H], features [B, T, n * H] or None)."""
        target = self.target
        target._captured = {}
        out = target.decoder(
            input_ids=input_ids,
            position_ids=positions[None] if positions.dim() == 1 else positions,
            attention_mask=masks,
            past_key_values=self.cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state
        features = None
        if target._context_layer_ids:
            features = torch.cat([target._captured[i] for i in target._context_layer_ids], dim=-1)
        target._captured = {}
        return target.target_logits(hidden), hidden, features

    def start(self, eager_cache, length: int) -> None:
        """Take over a prefilled eager cache (`TargetModel.new_cache` after the prompt's forward)."""
        if length + self.verify_length > self.capacity:
            raise FlashdraftError(
                f"static cache of {self.capacity} positions: {length} prompt tokens and a verify of "
                f"{self.verify_length} do not fit"
            )
        self.cache.seed(self.target, eager_cache, length)

    @torch.no_grad()
    def verify(self, input_ids: torch.Tensor) -> TargetOutput:
        """The target over input_ids [1, verify_length] at the committed position, writing the caches (commit next)."""
        if input_ids.shape != (1, self.verify_length):
            raise ValueError(f"static verify of {tuple(input_ids.shape)} tokens, expected (1, {self.verify_length})")
        logits, hidden, features = self.counted(self._step, input_ids)
        return TargetOutput(hidden, features, self.target.target_logits, _logits=logits)

    def counted(self, step, *args, graphs_per_warm_up: int = 1, new_step: bool = True):
        """`step(*args)` (one of the verifier's compiled functions), counting what dynamo compiled and broke into
        `counts`: the verifier's first `graphs_per_warm_up` graphs are its warm-up, any later one a recompile.
        `new_step` False: a graph of the same step (its inputs the step's earlier graph outputs)."""
        if self._mode == "reduce-overhead" and new_step:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's graph outputs are read no more
        if self.backend is None:
            return step(*args)
        graphs, breaks = dynamo_totals()
        start = time.perf_counter()
        out = step(*args)
        compiled, broken = dynamo_totals()
        if compiled > graphs:
            self.counts.compile_seconds += time.perf_counter() - start
            warm_up = max(0, min(compiled - graphs, graphs_per_warm_up - self.counts.compiles))
            self.counts.recompiles += compiled - graphs - warm_up
            self.counts.compiles += compiled - graphs
        self.counts.graph_breaks += broken - breaks
        return out

    def commit(self, accepted: int | torch.Tensor) -> None:
        self.cache.commit(accepted)


def static_verifier(target: TargetModel, verify_length: int, tokens: int, backend: str | None) -> StaticVerifier:
    """The target's verifier for this verify length and backend, made once and kept on the target (its buffers and
    compiled graph serve every later generation that fits); a larger one replaces it when `tokens` do not fit."""
    verifiers = target.__dict__.setdefault("_static_verifiers", {})
    key = (verify_length, backend, target.device, target.dtype)  # a target moved or cast gets buffers of its own
    verifier = verifiers.get(key)
    if verifier is None or verifier.capacity < tokens:
        verifier = StaticVerifier(target, verify_length, capacity_for(tokens), backend)
        verifiers[key] = verifier
    return verifier
