import torch

from ddpkit.config import TrainConfig
from ddpkit.models import MLP, TinyGPT, build_model, count_parameters, loss_fn


def test_mlp_is_the_handbook_shape():
    model = MLP()
    assert count_parameters(model) == (256 * 512 + 512) + (512 * 512 + 512) + (512 * 8 + 8)
    assert model(torch.randn(5, 256)).shape == (5, 8)


def test_gpt_attention_is_causal():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    idx = torch.randint(0, 64, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    before, after = model(idx), model(changed)
    assert before.shape == (2, 16, 64)
    torch.testing.assert_close(before[:, :10], after[:, :10])  # the past cannot see the future
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_gpt_has_a_separate_lm_head():
    model = TinyGPT()
    assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()


def test_build_model_is_identical_for_the_same_seed():
    a, b = build_model(TrainConfig(model="gpt")), build_model(TrainConfig(model="gpt"))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_loss_is_per_sample_for_both_models():
    logits, targets = torch.randn(4, 16, 64), torch.randint(0, 64, (4, 16))
    per_sample = loss_fn(logits, targets, reduction="none")
    assert per_sample.shape == (4,)
    torch.testing.assert_close(per_sample.mean(), torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
