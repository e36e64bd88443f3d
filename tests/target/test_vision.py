"""Vision-language targets (`flashdraft.target.vision`) on tiny random Qwen3-VL and Qwen3.5-layout models built from
their configs, with drawn images: the assembled processor against transformers' own Qwen3VLProcessor, the capture
point against the model's own forward, greedy decoding with an image against the model's own `generate`, the
served positions against the model's M-RoPE index, and the README pipeline end to end."""

from __future__ import annotations

import json

import pytest
import torch

from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from flashdraft.target.vision import (
    MROPE_ROW0,
    ImageProcessor,
    position_runs,
    positions_from_runs,
    served_position_scheme,
)
from tests.target.tiny_vision import IMAGE_TOKEN_ID, draw_image, save_vl_target

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t1 t2 t3"}]}]


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def vl_target(request, tmp_path_factory):
    directory = save_vl_target(tmp_path_factory.mktemp(request.param) / "target", request.param)
    return TargetModel.load(directory)


def encode(target: TargetModel, image=None):
    text = target.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    return target.processor.encode(text, [image or draw_image()], "the test prompt")


def test_the_assembled_processor_equals_transformers_qwen3_vl_processor(tmp_path, monkeypatch):
    """AutoProcessor cannot build Qwen3VLProcessor without torchvision (its video processor); built around the same
    PIL image processor with that class check off, its ids, pixels and grids are the assembled processor's."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    target = TargetModel.load(save_vl_target(tmp_path / "t", "qwen3_vl"))
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *a, **k: None)
    real = Qwen3VLProcessor(image_processor=target.processor.image_processor, tokenizer=target.tokenizer)
    images = [draw_image(size=(48, 32)), draw_image(size=(40, 64), seed=1)]
    text = "t1 <|vision_start|> <|image_pad|> <|vision_end|> t2 <|vision_start|> <|image_pad|> <|vision_end|>"
    expected = real(text=[text], images=images, return_tensors="pt")
    ids, inputs = target.processor.encode(text, images, "test")
    assert ids == expected["input_ids"][0].tolist()
    assert torch.equal(inputs.image_grid_thw, expected["image_grid_thw"])
    assert torch.equal(inputs.pixel_values, expected["pixel_values"])
    assert inputs.image_grid_thw[0].tolist() == [1, 4, 6]  # 48 x 32 pixels: 4 x 6 patches of 8
    assert ids.count(IMAGE_TOKEN_ID) == int((inputs.image_grid_thw.prod(-1) // 4).sum())  # over the 2 x 2 merge


def test_a_checkpoint_loads_whole_with_its_processor_and_a_foreign_image_processor_is_refused(vl_target, tmp_path):
    assert vl_target.vision is not None and isinstance(vl_target.processor, ImageProcessor)
    assert vl_target.position_scheme == MROPE_ROW0 == served_position_scheme(vl_target.model.config)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "SiglipImageProcessor"}))
    from flashdraft.errors import FlashdraftError

    with pytest.raises(FlashdraftError, match="image_processor_type 'SiglipImageProcessor'; expected one of"):
        ImageProcessor.from_directory(tmp_path, vl_target.tokenizer)
    # a checkpoint whose chat template is the processor's (chat_template.json) and not the tokenizer's
    real = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "merge_size": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(real))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": vl_target.tokenizer.chat_template}))
    tokenizer = type(vl_target.tokenizer).from_pretrained(vl_target.path)
    tokenizer.chat_template = None
    assert (
        ImageProcessor.from_directory(tmp_path, tokenizer).tokenizer.chat_template == vl_target.tokenizer.chat_template
    )


def test_context_features_are_taken_where_vllm_captures_them_after_deepstack(vl_target):
    """At each layer read: the input of the next layer (vLLM captures hidden_states + residual after the deepstack
    addition), which is the model's own output_hidden_states[l + 1] except at the image positions of Qwen3-VL's
    deepstack layers, where it is that plus the deepstack features; the logits are the model's own."""
    ids, inputs = encode(vl_target)
    vl_target.set_context_layers([0, 1, 2])
    next_input = {}

    def read_input(module, args, kwargs):  # what layer 1 reads: layer 0's output as the stream carries it on
        next_input[0] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    hook = vl_target.layers[1].register_forward_pre_hook(read_input, with_kwargs=True)
    with vl_target.images(ids, inputs) as prompt:
        out = vl_target.forward(torch.tensor([ids]))
    hook.remove()
    ref = vl_target.model(
        input_ids=torch.tensor([ids]),
        pixel_values=inputs.pixel_values,
        image_grid_thw=inputs.image_grid_thw,
        mm_token_type_ids=(torch.tensor([ids]) == IMAGE_TOKEN_ID).int(),
        output_hidden_states=True,
    )
    h = vl_target.hidden_size
    features = out.context_features[0].split(h, dim=-1)
    torch.testing.assert_close(features[0], next_input[0][0], rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    image = prompt.image_mask
    for k, layer in enumerate([0, 1, 2]):
        expected = ref.hidden_states[layer + 1][0].clone()
        if prompt.deepstack is not None and layer < len(prompt.deepstack):
            expected[image] += prompt.deepstack[layer]
        torch.testing.assert_close(features[k], expected, rtol=1e-5, atol=1e-5)
    assert (prompt.deepstack is not None) == (vl_target.model.config.model_type == "qwen3_vl")


def test_greedy_speculative_decoding_with_an_image_is_the_models_own_greedy_generate_and_compile_is_refused(vl_target):
    from flashdraft.decoding.generate import SpeculativeConfig, speculative_generate
    from flashdraft.drafter.init import DrafterChoices, new_drafter_for_target

    ids, inputs = encode(vl_target)
    own = vl_target.model.generate(
        input_ids=torch.tensor([ids]),
        pixel_values=inputs.pixel_values,
        image_grid_thw=inputs.image_grid_thw,
        mm_token_type_ids=(torch.tensor([ids]) == IMAGE_TOKEN_ID).int(),
        max_new_tokens=12,
        do_sample=False,
    )[0, len(ids) :].tolist()
    drafter = new_drafter_for_target(vl_target, DrafterChoices(num_layers=1, block_size=4, target_layer_ids=[1, 2]))
    vl_target.register_images(ids, lambda: inputs, "the test prompt", ("drawn",))
    result = speculative_generate(vl_target, drafter, ids, 12)
    assert result.output_ids == own
    without_image = vl_target.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert without_image[0, len(ids) :].tolist() != own  # the image is in the context decoded
    # the static verify has one position row: after an image M-RoPE's would trail it, so --compile is refused
    with pytest.raises(FlashdraftError, match="--compile refused: a vision-language target"):
        speculative_generate(vl_target, drafter, ids, 12, speculative=SpeculativeConfig(compile=True))


def test_the_drafter_positions_are_m_rope_row_0_as_vllm_serves_them(vl_target):
    """Context and block positions as vLLM's DFlash proposer gives them for an M-RoPE target: row 0 of the model's
    own M-RoPE index; after a 4 x 6-patch image (6 placeholders) row 0 has advanced by 3, the index by 6."""
    ids, inputs = encode(vl_target)
    with vl_target.images(ids, inputs) as prompt:
        served = vl_target.drafter_positions(torch.arange(len(ids) + 4))
    mask = (torch.tensor([ids]) == IMAGE_TOKEN_ID).int()
    rows, delta = vl_target.model.model.get_rope_index(torch.tensor([ids]), mask, image_grid_thw=inputs.image_grid_thw)
    assert torch.equal(served[: len(ids)], rows[0, 0])
    assert served[len(ids) :].tolist() == [len(ids) + int(delta) + k for k in range(4)] and int(delta) == 3 - 6
    assert int(served[len(ids) - 1]) == len(ids) - 1 - 3  # the index would be 3 further
    runs = position_runs(served)
    assert torch.equal(positions_from_runs(runs, len(served)), served) and prompt.rope_delta == -3


def test_position_runs_round_trip_any_positions():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        steps = torch.randint(0, 3, (30,), generator=g).clamp(max=1)  # 0: a repeated position, 1: the next
        jumps = torch.randint(0, 4, (30,), generator=g) * (torch.rand(30, generator=g) < 0.2)
        positions = torch.cumsum(steps + jumps, 0)
        assert torch.equal(positions_from_runs(position_runs(positions), 30), positions)
    assert positions_from_runs(None, 5).tolist() == [0, 1, 2, 3, 4]


def test_a_qwen3_5_checkpoint_is_the_same_target_loaded_whole_from_its_files_or_as_text(tmp_path):
    """The fingerprint leaves the vision tower out and names the language model as its text-only layout does: caches
    and drafters made while the checkpoint loaded as text (no preprocessor_config.json) stay its own."""
    import shutil

    from flashdraft.target.weights import TargetHead

    whole = save_vl_target(tmp_path / "whole", "qwen3_5")
    text = tmp_path / "text"
    shutil.copytree(whole, text)
    (text / "preprocessor_config.json").unlink()
    loaded, as_text = TargetModel.load(whole), TargetModel.load(text)
    assert loaded.vision is not None and as_text.vision is None
    assert loaded.fingerprint() == TargetHead.load(whole).fingerprint() == as_text.fingerprint()
