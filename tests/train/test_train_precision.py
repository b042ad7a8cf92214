"""Training dtypes (train/precision.py): trainable weights become fp32, the frozen embedding
and lm_head are not copied under mixed precision and are upcast once (tied ones together) in
plain fp32, and the bf16 loss and gradients equal those of the former `head.float()`."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import train.loop as loop
from heads.batch import PackedBatch
from heads.config import HeadConfig
from heads.frozen import FrozenParts
from heads.registry import build_head
from inference_eval.hydra_app import compose
from inference_eval.engine.model.arch import ModelArch
from train.config import TrainConfig
from train.precision import cast_for_training


def _bf16_head(tied: bool, head_type: str = "mtp"):
    arch = ModelArch(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=32,
                     intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=64, tie_word_embeddings=tied)
    g = torch.Generator().manual_seed(0)
    embed = (torch.randn(96, 32, generator=g) * 0.3).bfloat16()
    lm_head = embed if tied else (torch.randn(96, 32, generator=g) * 0.3).bfloat16()
    parts = FrozenParts(arch, embed, (1 + 0.1 * torch.randn(32, generator=g)).bfloat16(), lm_head,
                        {"name": "t", "arch": arch.to_dict()})
    return build_head(HeadConfig(type=head_type, num_steps=2, distill_temperature=0.5), parts), embed


def _batch(n=40):
    g = torch.Generator().manual_seed(1)
    return PackedBatch(torch.randint(0, 96, (n,), generator=g), torch.randn(n, 32, generator=g),
                       torch.rand(n, generator=g) > 0.2, [25, 15])


@pytest.mark.parametrize("tied", [True, False])
def test_mixed_precision_keeps_frozen_tensors_as_loaded(tied):
    head, embed = _bf16_head(tied)
    cast_for_training(head, "bf16")
    assert all(p.dtype == torch.float32 for p in head.parameters() if p.requires_grad)
    assert head.embed.dtype == head.frozen.weight.dtype == torch.bfloat16
    assert head.embed.data_ptr() == embed.data_ptr()  # the target's tensor itself, no copy
    assert (head.embed.data_ptr() == head.frozen.weight.data_ptr()) == tied
    assert head.rope_cos.dtype == torch.float32


def test_plain_fp32_upcasts_tied_frozen_tensors_once():
    head, embed = _bf16_head(tied=True)
    cast_for_training(head, "no")
    assert head.embed.dtype == head.frozen.weight.dtype == torch.float32
    assert head.embed.data_ptr() == head.frozen.weight.data_ptr()  # one fp32 copy, not two
    torch.testing.assert_close(head.embed, embed.float(), rtol=0, atol=0)
    old, _ = _bf16_head(tied=True)
    old = old.float()  # what the trainer did before: a module cast copies each buffer apart
    assert old.embed.data_ptr() != old.frozen.weight.data_ptr()


@pytest.mark.parametrize("head_type", ["mtp", "eagle1"])
def test_bf16_autocast_loss_and_gradients_equal_the_full_upcast(head_type):
    new, _ = _bf16_head(tied=False, head_type=head_type)
    old = copy.deepcopy(new).float()
    cast_for_training(new, "bf16")
    batch = _batch()
    grads = []
    for head in (old, new):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, stats = head(batch, chunk=16)
        loss.backward()
        grads.append((loss.detach(), stats, {n: p.grad for n, p in head.named_parameters()
                                             if p.requires_grad}))
    (l_old, s_old, g_old), (l_new, s_new, g_new) = grads
    assert l_new.item() == l_old.item()
    torch.testing.assert_close(s_new, s_old, rtol=0, atol=0)
    assert g_new.keys() == g_old.keys()
    for k in g_old:
        torch.testing.assert_close(g_new[k], g_old[k], rtol=0, atol=0)


def test_trainer_holds_bf16_target_tied_tables_once(tmp_path, common, make_shards, monkeypatch):
    """A bf16 target trained in fp32 on the CPU: one fp32 table serves embedding and lm_head."""
    shards = make_shards(tmp_path / "shards", ["target.dtype=bfloat16"], num_shards=1)
    cfg = compose("train", TrainConfig, [*common, "target.dtype=bfloat16", f"data.shards={shards}",
                                         f"output_dir={tmp_path / 'out'}", "trainer.max_steps=2"])
    held = {}
    real = loop.save_final_head

    def capture(full, path, extra):
        held["head"] = full.module
        return real(full, path, extra)

    monkeypatch.setattr(loop, "save_final_head", capture)
    last = loop.train(cfg)
    head = held["head"]
    assert head.embed.dtype == torch.float32 and head.arch.tie_word_embeddings
    assert head.embed.data_ptr() == head.frozen.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in head.parameters())
    assert last["step"] == 2 and last["loss"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA bf16 training run needs a GPU")
def test_cuda_bf16_training_follows_the_cpu_fp32_run(tmp_path, common, shards, run_train):
    """`python -m train` on CUDA with bf16 autocast: the same steps as the fp32 CPU run,
    losses within bf16 rounding of them at every step, and the loss goes down on both."""
    base = [o for o in common if not o.startswith("trainer.device=")]
    losses = {}
    for device, precision in (("cpu", "no"), ("cuda", "bf16")):
        out = tmp_path / device
        res = run_train(*base, f"data.shards={shards}", "trainer.max_steps=8",
                        f"trainer.device={device}", f"trainer.mixed_precision={precision}",
                        f"output_dir={out}")
        assert res.returncode == 0, res.stderr[-3000:]
        losses[device] = [h["loss"] for h in json.loads((out / "train_metrics.json").read_text())]
    cpu, cuda = losses["cpu"], losses["cuda"]
    assert len(cpu) == len(cuda) == 8
    assert cuda[-1] < cuda[0] - 0.1 and cpu[-1] < cpu[0] - 0.1, (cpu, cuda)
    for a, b in zip(cpu, cuda):
        assert abs(a - b) <= 0.02 * abs(a), (cpu, cuda)
