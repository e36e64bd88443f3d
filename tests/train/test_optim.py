import math

import pytest
import torch

from flashdraft.errors import FlashdraftError
from flashdraft.train.config import TrainConfig
from flashdraft.train.optim import WholeMatrixMuon, build_optimizers, is_muon_parameter, lr_lambda
from tests.conftest import make_drafter


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    f = lr_lambda(total_steps=100, warmup_fraction=0.04, min_lr_fraction=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(f(4), 1.0) and f(52) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-12)
    assert f(100) == pytest.approx(0.1) and f(1000) == pytest.approx(0.1)  # past the end: the floor, never negative


def test_muon_takes_the_layer_matrices_and_fc_and_adamw_the_norms():
    drafter = make_drafter(block_size=4)
    muon = {n for n, p in drafter.named_parameters() if is_muon_parameter(n, p)}
    assert "fc.weight" in muon and "layers.1.mlp.down_proj.weight" in muon
    assert not any("norm" in n for n in muon)
    assert is_muon_parameter("module.layers.0.self_attn.q_proj.weight", torch.zeros(2, 2))  # DDP's prefix
    assert not is_muon_parameter("lm_head.weight", torch.zeros(2, 2))  # an own LM head stays with AdamW
    optimizers = build_optimizers(drafter, TrainConfig(optimizer="muon", lr=1e-3, warmup_fraction=0.1), 10)
    adamw, whole_matrix_muon = (o for o, _ in optimizers.pairs)
    assert isinstance(whole_matrix_muon, WholeMatrixMuon)
    counted = sum(len(g["params"]) for o in (adamw, whole_matrix_muon) for g in o.param_groups)
    assert counted == len(list(drafter.parameters()))  # every parameter in exactly one optimizer
    assert sum(len(g["params"]) for g in whole_matrix_muon.param_groups) == len(muon)


def test_whole_matrix_muon_on_plain_tensors_in_bfloat16_is_torch_muon_bit_for_bit():
    torch.manual_seed(0)
    weights = [torch.randn(8, 16), torch.randn(32, 8)]
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    theirs = [torch.nn.Parameter(w.clone()) for w in weights]
    mine = WholeMatrixMuon(ours, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.bfloat16)
    torch_muon = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        grads = [torch.randn_like(w) for w in weights]
        for params, optimizer in ((ours, mine), (theirs, torch_muon)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert not torch.equal(ours[0], weights[0])


def test_muon_on_a_cpu_orthogonalises_in_float32_within_bfloat16_rounding_of_torchs_step():
    # bfloat16 matrix products are emulated on CPUs without hardware support (11x slower here): float32 there
    torch.manual_seed(0)
    weight, grad = torch.randn(64, 24), torch.randn(64, 24)
    steps = {}
    for dtype in (None, torch.bfloat16):
        param = torch.nn.Parameter(weight.clone())
        param.grad = grad.clone()
        WholeMatrixMuon([param], lr=0.02, adjust_lr_fn="match_rms_adamw", ns_dtype=dtype).step()
        steps[dtype] = param.detach() - weight
    fp32, bf16 = steps[None], steps[torch.bfloat16]
    assert not torch.equal(fp32, bf16)  # another computation ...
    assert float((fp32 - bf16).norm() / bf16.norm()) < 0.05  # ... of the same update


def test_resume_with_another_optimizer_is_refused_naming_the_checkpoint():
    drafter = make_drafter(block_size=4)
    saved = build_optimizers(drafter, TrainConfig(optimizer="adamw", lr=1e-3, warmup_fraction=0.1), 10).state_dict()
    muon = build_optimizers(drafter, TrainConfig(optimizer="muon", lr=1e-3, warmup_fraction=0.1), 10)
    with pytest.raises(FlashdraftError, match=r"ckpt/step-1: saved with 1 optimizer\(s\); this run has 2"):
        muon.load_state_dict(saved, "ckpt/step-1")


def test_an_unknown_optimizer_is_refused_with_the_choices():
    with pytest.raises(FlashdraftError, match="--optimizer sgd: expected one of adamw, muon"):
        build_optimizers(make_drafter(block_size=4), TrainConfig(optimizer="sgd", lr=1e-3, warmup_fraction=0.1), 10)
