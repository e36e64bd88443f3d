"""What vLLM and SGLang do with each family's drafter (DFlash, DFlash2, DSpark): the rules `doctor --serving`
checks per family, read from vLLM 0.33.0 and SGLang 0.5.23 (the files named per rule)."""

from __future__ import annotations

import json
from typing import Any

from flashdraft.drafter.config import REFERENCE_OPTIONS, DrafterConfig
from flashdraft.drafter.doctor_report import Checks
from flashdraft.drafter.families import family
from flashdraft.drafter.server_fields import SGLANG, VLLM

SLIDING, FULL = "sliding_attention", "full_attention"
V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER=1"
VLLM_DFLASH2 = "qwen3_dflash2.py (v1/worker/gpu/spec_decode/dflash2/)"
VLLM_DSPARK = "qwen3_dspark.py (v1/worker/gpu/spec_decode/dspark/speculator.py)"


def mixes_sliding_and_full(cfg: DrafterConfig) -> bool:
    """vLLM 0.33.0 serves such a drafter only with the V2 model runner."""
    return 0 < cfg.layer_types.count(SLIDING) < len(cfg.layer_types)


def needs_v2_runner(cfg: DrafterConfig) -> bool:
    """Drafters vLLM 0.33.0 serves only on its V2 model runner (its default): mixed layers and the families that say
    so (DFlash2); the V1 runner (chosen when a feature V2 lacks is asked for) refuses them with an error. The command
    pins V2."""
    return family(cfg.family).v2_runner_only or mixes_sliding_and_full(cfg)


def full_vocabulary(why: str, checks: Checks) -> None:
    """The vocabulary line of a family drafting over the full target vocabulary (DrafterConfig refuses a
    draft_vocab_size there: it always holds)."""
    checks.ok(f"vocabulary: the full target vocabulary (no draft_vocab_size, no d2t): {why}")


class DFlashServing:
    """What vLLM and SGLang do with a DFlash drafter, in the serving checks' words. DFlash2's and DSpark's classes
    override what differs; a family without a class of its own is checked as DFlash."""

    # format: the registries' entry for the architecture (both read config.json through transformers' Qwen3Config)
    registry = (
        f"{VLLM} models/registry.py maps DFlashDraftModel to qwen3_dflash.py DFlashQwen3ForCausalLM, "
        f"{SGLANG} to models/dflash.py DFlashDraftModel"
    )

    def tensors(self, cfg: DrafterConfig, expected: dict[str, tuple[int, ...]]) -> str:
        """The tensors both loaders read, and what they do with one missing or unknown."""
        return (
            f"every public key with its shape ({VLLM} qwen3_dflash.py DFlashQwen3ForCausalLM.load_weights "
            f"stacks q/k/v and gate/up and refuses unknown names; {SGLANG} models/dflash.py "
            f"DFlashDraftModel.load_weights skips unknown names; neither notices a missing tensor)"
        )

    def runner(self, cfg: DrafterConfig, checks: Checks) -> None:
        """vLLM 0.33.0 runs its V2 model runner by default (config/vllm.py use_v2_model_runner); its V1 runner, chosen
        when a feature V2 lacks is asked for, refuses DFlash2, DSpark and mixed layers (_validate_v1_model_runner)."""
        if mixes_sliding_and_full(cfg):
            checks.ok(
                f"V2 runner: layers mix sliding and full attention: {VLLM} serves them on its V2 model runner, "
                f'its default; its V1 runner refuses them ("Model Runner V1 does not support: mixed '
                f'sliding/full dflash drafts"); the vLLM command below pins V2 ({V2_RUNNER})'
            )
        else:
            checks.ok(
                f"V2 runner: layers all {cfg.layer_types[0]}: either {VLLM} model runner serves them (V2, its "
                f"default; V1 refuses mixed layers and the candidate-head and DSpark families only)"
            )

    def layout(self, raw: dict[str, Any], cfg: DrafterConfig, checks: Checks) -> None:
        """The block layout each server drafts the drafter with: the family's, from its architectures."""
        checks.ok(
            f"layout: {cfg.describe_layout()}: {VLLM} and {SGLANG} draft a {cfg.architecture} so (1 + N "
            f"queries, the masks at the drafted positions)"
        )

    def heads(self, raw: dict[str, Any], cfg: DrafterConfig, checks: Checks) -> None:
        """The family's own heads as each server builds them (DFlash has none)."""

    def vocabulary(self, cfg: DrafterConfig, found: dict[str, Any], checks: Checks) -> None:
        """A reduced vocabulary with its own LM head: vLLM's convention, which SGLang's DFlash does not load."""
        if cfg.draft_vocab_size is None:
            checks.ok(
                f"vocabulary: no own LM head: both servers draft with the target's lm_head ({VLLM} "
                f"llm_base_proposer.py _maybe_share_lm_head; {SGLANG} speculative/dflash_worker_v2.py)"
            )
            return
        own = f"draft_vocab_size {cfg.draft_vocab_size} with its own lm_head" + (" and d2t" if "d2t" in found else "")
        checks.warn(
            f"vocabulary: {own}: {VLLM} serves it (qwen3_dflash.py DFlashQwen3ForCausalLM.load_weights loads "
            f"lm_head and maps d2t to draft_id_to_target_id, compute_logits places the drafts in the target "
            f"vocabulary); {SGLANG} does not: models/dflash.py DFlashDraftModel has no lm_head, its load_weights "
            f"skips lm_head.weight and d2t without a word, and speculative/dflash_worker_v2.py drafts with the "
            f"target's lm_head over the full vocabulary",
            "serve this drafter with vLLM (on SGLang its drafts would come from another head than it was trained with)",
        )

    def block(self, cfg: DrafterConfig, checks: Checks) -> None:
        b = cfg.block_size
        checks.ok(
            f"block size: block_size {b}: {VLLM} ignores it and needs num_speculative_tokens {b - 1} (= block_size "
            f"- 1; config/speculative.py SpeculativeConfig.__post_init__ refuses none); {SGLANG} defaults "
            f"--speculative-num-draft-tokens to block_size, anchor included (arg_groups/speculative_hook.py "
            f"_handle_dflash); both commands below give them"
        )

    def scalings(self, cfg: DrafterConfig, checks: Checks) -> None:
        """The z-lab reference's DFlash2 scalings: flashdraft applies them, plain DFlash serving does not."""
        changed = {
            n: cfg.reference_option(n)
            for n, default in REFERENCE_OPTIONS.items()
            if cfg.reference_option(n) not in (default, 0)
        }
        where = (
            f"{VLLM} qwen3_dflash.py and {SGLANG} models/dflash.py DFlashDraftModel read none of them; only "
            f"the DFlash2 models do (qwen3_dflash2.py, DFlash2DraftModel)"
        )
        for name, value in changed.items():
            checks.warn(
                f"scalings: dflash_config.{name} {value}: flashdraft trains and evaluates with it, but {where}",
                "expect served acceptance to differ from flashdraft's; train without it to serve it as plain DFlash",
            )
        if not changed:
            checks.ok(
                f"scalings: input_embedding_scale, output_multiplier, final_logit_softcapping at their "
                f"defaults: {where}"
            )


class DFlash2Serving(DFlashServing):
    # vLLM's method stays "dflash": the architectures entry alone selects DFlash2
    registry = (
        f"{VLLM} models/registry.py maps DFlash2DraftModel to {VLLM_DFLASH2}, V2 runner (its default), with "
        f'--speculative-config method "dflash" as for DFlash (architectures selects DFlash2); {SGLANG} '
        f"--speculative-algorithm DFLASH to models/dflash.py, which reads DFlash2's fields"
    )

    def tensors(self, cfg: DrafterConfig, expected: dict[str, tuple[int, ...]]) -> str:
        # a conv or selector tensor left out is served uninitialised, without a word
        from flashdraft.drafter.model import is_dflash2_parameter

        extra = sum(map(is_dflash2_parameter, expected))
        return (
            f"every public key with its shape, DFlash2's {extra} included (layers.i.attention_conv / mlp_conv "
            f"base_kernel and candidate_selector predecessor_codebook / successor_codebook without '.weight', as "
            f"published; {VLLM} {VLLM_DFLASH2} and {SGLANG} models/dflash.py load them by these names; neither "
            f"notices a missing tensor)"
        )

    def runner(self, cfg: DrafterConfig, checks: Checks) -> None:
        mixed = "; its layers also mix sliding and full attention, which V1 refuses too" * mixes_sliding_and_full(cfg)
        checks.ok(
            f"V2 runner: DFlash2DraftModel: {VLLM} runs {VLLM_DFLASH2} on its V2 model runner, its default; "
            f'its V1 runner (chosen when a feature V2 lacks is asked for) refuses it with "Model Runner V1 does '
            f'not support: DFlash candidate-head drafts"{mixed}; the vLLM command below pins V2 ({V2_RUNNER})'
        )

    def vocabulary(self, cfg: DrafterConfig, found: dict[str, Any], checks: Checks) -> None:
        full_vocabulary(
            f"DFlash2's candidate selector ranks the target's lm_head logits, codebooks "
            f"[{cfg.vocab_size}, {cfg.selector_rank}] (vocab_size, selector_rank), as {VLLM} "
            f"qwen3_dflash2.py and {SGLANG} models/dflash.py load it",
            checks,
        )

    def block(self, cfg: DrafterConfig, checks: Checks) -> None:
        # the conv's taps stop at the block boundary: the block must be the trained one
        b = cfg.block_size
        checks.ok(
            f"block size: block_size {b}: {VLLM} {VLLM_DFLASH2} takes the convolutions' block length from "
            f"1 + num_speculative_tokens, not from block_size: num_speculative_tokens {b - 1} (= block_size - "
            f"1); any other value convolves across a different block than the drafter was trained with; the "
            f"vLLM command below gives {b - 1}"
        )
        checks.ok(
            f"SGLang DFlash2: --speculative-algorithm DFLASH with --speculative-num-draft-tokens {b} (= "
            f"block_size, anchor included): {SGLANG} models/dflash.py reads DFlash2's fields (conv_kernel_size "
            f"{cfg.conv_kernel_size}, conv_group_size {cfg.conv_group_size}, selector_rank {cfg.selector_rank}, "
            f"selector_top_k {cfg.selector_top_k}, block_size {b}); the SGLang command below gives "
            f"them"
        )

    def scalings(self, cfg: DrafterConfig, checks: Checks) -> None:
        # served as trained: the DFlash2 models read them
        values = ", ".join(f"{n} {cfg.reference_option(n)}" for n in REFERENCE_OPTIONS)
        checks.ok(
            f"scalings: {values}: {VLLM} qwen3_dflash2.py and {SGLANG} models/dflash.py read them for a "
            f"DFlash2DraftModel, as flashdraft trains and evaluates with them"
        )


class DSparkServing(DFlashServing):
    registry = (
        f"{VLLM} models/registry.py maps Qwen3DSparkModel to {VLLM_DSPARK} with --speculative-config method "
        f'"dspark" (its DSparkDraftModel is DeepSeek-V4\'s); {SGLANG} --speculative-algorithm DSPARK to '
        f"models/dspark.py Qwen3DSparkModel"
    )

    def layout(self, raw: dict[str, Any], cfg: DrafterConfig, checks: Checks) -> None:
        checks.ok(
            f"layout: {cfg.describe_layout()}: {VLLM} dspark/speculator.py (sample_from_anchor "
            f"{json.dumps(raw.get('sample_from_anchor', True))}: N queries, sample_pos = query_pos + 1) and "
            f"{SGLANG} models/dspark.py (DeepSpec's slot k -> anchor + k + 1) draft it so; trained and "
            f"evaluated so by flashdraft (a DFlash-layout decode of it is accepted under 1 %, vLLM #56792)"
        )

    def heads(self, raw: dict[str, Any], cfg: DrafterConfig, checks: Checks) -> None:
        """DSpark's heads as each server builds them from config.json as written."""
        absent = [name for name in ("enable_confidence_head", "confidence_head_with_markov") if name not in raw]
        checks.check(
            not absent,
            f"confidence head: enable_confidence_head {json.dumps(raw.get('enable_confidence_head'))}, "
            f"confidence_head_with_markov {json.dumps(raw.get('confidence_head_with_markov'))} written "
            f"({VLLM} qwen3_dspark.py reads absent fields as false, {SGLANG} build_confidence_head as true)",
            "re-export it (flashdraft export writes both fields)",
        )
        if cfg.confidence_head:
            checks.warn(
                f"adaptive verification: the confidence head estimates each draft's acceptance; {VLLM}'s "
                f"adaptive verification (enable_adaptive_verification, off by default) picks a batch budget "
                f"from expected accepted tokens over cost, {SGLANG}'s ragged verify planner is opt-in: the "
                f"commands below verify whole blocks, as flashdraft eval measures by default",
                "flashdraft eval --confidence-threshold C reports DeepSpec's evaluator's threshold cut (its τ "
                "and drafts verified per step), not either server's rule",
            )
        else:
            checks.ok("adaptive verification: no confidence head: both servers verify whole blocks")
        if cfg.draft_top_k is not None:
            checks.warn(
                f"dspark_draft_topk {cfg.draft_top_k}: {VLLM} dspark/speculator.py adds the Markov bias to "
                f"the top-{cfg.draft_top_k} base candidates only (flashdraft drafts so); {SGLANG} does not "
                f"read it and biases the whole vocabulary",
                "serve it with vLLM, or drop dspark_draft_topk for SGLang",
            )
        checks.ok(
            f"Markov head: vanilla, rank {cfg.markov_rank}: {VLLM} DSparkMarkovHead and {SGLANG} VanillaMarkov "
            f"add W2 W1[previous draft] to each position's logits, drafting left to right from the anchor"
        )

    def tensors(self, cfg: DrafterConfig, expected: dict[str, tuple[int, ...]]) -> str:
        # SGLang refuses a missing confidence tensor; vLLM drops the head without a word
        return (
            f"every public key with its shape, the Markov head's markov_head.markov_w1 / markov_w2.weight "
            f"[{cfg.vocab_size}, {cfg.markov_rank}]"
            + (" and confidence_head.proj.weight / bias" if cfg.confidence_head else "")
            + f" included ({VLLM} qwen3_dspark.py load_weights drops a confidence head it does not find; "
            f"{SGLANG} models/dspark.py refuses unknown Markov weights and a missing confidence head)"
        )

    def block(self, cfg: DrafterConfig, checks: Checks) -> None:
        # the layers are non-causal in the block: a block of another length computes other drafts
        checks.ok(
            f"block size: block_size {cfg.block_size}: {VLLM} {VLLM_DSPARK} drafts num_speculative_tokens N "
            f"queries (the anchor and N - 1 masks, all drafting), so N must be {cfg.block_size} (= block_size): "
            f"a shorter block changes what every position of the non-causal layers sees; {SGLANG} takes "
            f"--speculative-dspark-block-size {cfg.block_size}; both commands below give it"
        )

    def vocabulary(self, cfg: DrafterConfig, found: dict[str, Any], checks: Checks) -> None:
        full_vocabulary(
            f"the Markov head's bias is over the target's lm_head vocabulary, as {VLLM} qwen3_dspark.py "
            f"and {SGLANG} models/dspark.py load it",
            checks,
        )


SERVING = {"dflash": DFlashServing(), "dflash2": DFlash2Serving(), "dspark": DSparkServing()}


def serving_of(cfg: DrafterConfig) -> DFlashServing:
    """What the servers do with the drafter's family (a family without its own class: as DFlash)."""
    return SERVING.get(cfg.family, SERVING["dflash"])
