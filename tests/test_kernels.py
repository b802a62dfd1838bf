"""The kernel switches: flex attention, torch.compile of the decoder layers, Liger
kernels and expandable segments. Each is decided once (sft_play.run), applied where it acts, and
falls back or refuses clearly where its package or a GPU is missing. How fast each is on a GPU is
make bench-gpu's business (its B+lever rows), not these tests'."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from sft_play import config as config_module
from sft_play import model as model_module
from sft_play import patches
from sft_play.planner import WITHOUT_REMEDIES, Target, make_plan
from sft_play.planner.simulate.predict import predict
from sft_play.planner.simulate.timing import efficiency
from sft_play.run import resolve
from tests.conftest import LORA, with_kernels

REPO = Path(__file__).resolve().parents[1]
H100 = Target(1, 80 * 1024**3, "NVIDIA H100 80GB HBM3")


def load(*overrides: str):
    return config_module.load(REPO / "configs" / "run_tiny.yaml", [*LORA, *overrides], check_paths=False)


def test_liger_without_its_package_is_a_config_error_that_says_how_to_install_it():
    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    with pytest.raises(config_module.ConfigError) as raised:
        load("train.liger_kernels=true")
    assert "pip install liger-kernel" in str(raised.value)


def test_cuda_only_switches_are_off_without_cuda_and_the_plan_says_so(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "liger_kernel" else real_find_spec(name, *a))
    config = load("train.liger_kernels=true", "train.expandable_segments=true")
    cpu = resolve(config, on_cuda=False, bf16_supported=False, world_size=1)
    assert not cpu.kernels.liger and not cpu.kernels.expandable_segments
    gpu = resolve(config, on_cuda=True, bf16_supported=True, world_size=1)
    assert gpu.kernels.liger and gpu.kernels.expandable_segments
    plan = make_plan(config, Target(1, 8 * 1024**3, "CPU (host memory)", on_cuda=False), options=WITHOUT_REMEDIES)
    assert "train.liger_kernels: off without CUDA (Triton kernels)" in plan.notes
    assert "train.expandable_segments: off without CUDA" in plan.notes
    on_gpu = make_plan(config, H100, options=WITHOUT_REMEDIES)
    assert any("Liger's RoPE and SwiGLU, expandable segments: planned without the memory they may save" in n
               for n in on_gpu.notes), on_gpu.notes
    assert any(n.startswith("Liger's RMSNorm: planned as its fused kernel allocates") for n in on_gpu.notes)
    assert "Liger kernels: not yet measured" in efficiency(gpu)[1]


def test_the_trainer_gets_liger_from_the_resolved_run():
    from sft_play.run import BatchSplit
    from sft_play.training import trainer_arguments

    config = load()
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1).with_changes(batch=BatchSplit(2, 1, 1, 2))
    assert trainer_arguments(config, run, Path("/tmp/unused"), False).use_liger_kernel is False
    liger = trainer_arguments(config, with_kernels(run, liger=True), Path("/tmp/unused"), False)
    assert liger.use_liger_kernel and liger.liger_kernel_config is None
    # the trainer binds Liger's SwiGLU over each MLP's forward as it trains: tiled MLPs keep theirs
    tiled = trainer_arguments(config, with_kernels(run, liger=True, tiled_mlp=True), Path("/tmp/unused"), False)
    assert tiled.liger_kernel_config == {"swiglu": False}


def test_flex_attention_takes_packed_rows_without_a_mask_and_is_planned_like_flash():
    # (without the default's trained embedding and head copies, whose fp32 stream and head peak
    # alike under either kernel on this small model)
    flex = resolve(load("model.attn_implementation=flex_attention", "lora.modules_to_save=[]"), on_cuda=True,
                   bf16_supported=True, world_size=1)
    sdpa = resolve(load("model.attn_implementation=sdpa", "lora.modules_to_save=[]"), on_cuda=True,
                   bf16_supported=True, world_size=1)
    assert flex.kernels.collator == sdpa.kernels.collator == "packed_rows"  # per-example position ids, no mask tensor
    assert not flex.masked(4) and sdpa.masked(4)
    flash = with_kernels(flex, attention="flash_attention_2", collator="padding_free")
    from sft_play.planner import WITHOUT_REMEDIES, model_shape

    shape = model_shape(load("lora.modules_to_save=[]"))
    assert predict(shape, flex, 4).peak_bytes < predict(shape, sdpa, 4).peak_bytes  # no s x s mask per layer
    assert predict(shape, flex, 4).allocated_bytes == predict(shape, flash, 4).allocated_bytes
    plan = make_plan(load("model.attn_implementation=flex_attention"), H100, options=WITHOUT_REMEDIES)
    assert plan.attention == "flex_attention" and not plan.attention_mask


def test_flex_attention_keeps_packed_examples_apart_like_sdpa(monkeypatch):
    # SDPA's block-diagonal mask from the position ids is tested with the data (test_data.py);
    # flex attention builds a block mask from the same position ids and must give the same logits.
    # What is tested is the mask: flex attention runs uncompiled here (PyTorch's reference path
    # with the same mask and score functions), as inductor's CPU kernels took 20 s of the suite
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from transformers import masking_utils
    from transformers.integrations import flex_attention as transformers_flex

    from sft_play.data.collate import PackedRowsCollator

    monkeypatch.setattr(transformers_flex.WrappedFlexAttention, "__call__", lambda self: flex.flex_attention)
    monkeypatch.setattr(masking_utils, "create_block_mask",
                        lambda *args, **kwargs: flex.create_block_mask(*args, **{**kwargs, "_compile": False}))
    ids = list(range(5, 25)) + list(range(40, 52))  # two examples packed in one row: 20 and 12 tokens
    batch = PackedRowsCollator(pad_token_id=0)([{"input_ids": ids, "labels": ids, "seq_lengths": [20, 12]}])
    logits = {}
    for kernel in ("sdpa", "flex_attention"):
        config = load(f"model.attn_implementation={kernel}", "finetune.method=full")
        run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1)
        model = model_module.load_model(config, run, device="cpu").eval()
        assert model.config._attn_implementation == kernel
        with torch.no_grad():
            logits[kernel] = model(**batch).logits
    torch.testing.assert_close(logits["flex_attention"], logits["sdpa"], rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # and the second example sees nothing of the first
        alone = model_module.load_model(config, with_kernels(run, attention="sdpa"), device="cpu").eval()(
            input_ids=torch.tensor([ids[20:]])).logits
    torch.testing.assert_close(logits["flex_attention"][:, 20:], alone, rtol=1e-4, atol=1e-4)


def test_the_loss_head_projects_only_labelled_positions_on_a_cpu_to_the_same_loss(monkeypatch):
    """TRL's fused head projects every position where there is no Triton; on a CPU training and
    make eval take the labelled ones only (patches.labelled_positions_on_cpu): the same loss,
    a fraction of the projections."""
    import trl.trainer.utils as trl_utils

    config = load("finetune.method=full")
    model = model_module.load_model(config, resolve(config, on_cuda=False, bf16_supported=False, world_size=1),
                                    device="cpu")
    trl_utils.add_fused_lm_head(model)
    ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :20] = -100  # a prompt without labels, an answer with
    projected = []
    real = trl_utils._ChunkedLogProbFunction.apply
    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply",
                        lambda hidden, *args: projected.append(hidden.shape[0]) or real(hidden, *args))
    trl_own = getattr(trl_utils._use_triton, "trl_decision", trl_utils._use_triton)
    monkeypatch.setattr(trl_utils, "_use_triton", trl_own)  # as TRL decides (a test before may have switched)
    every = model(input_ids=ids, labels=labels, fused_lm_head=True)
    patches.labelled_positions_on_cpu()
    patches.labelled_positions_on_cpu()  # once is enough; twice changes nothing
    labelled = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert projected == [2 * 31, int((labels[:, 1:] != -100).sum())] == [62, 24]
    torch.testing.assert_close(labelled.loss, every.loss, rtol=1e-6, atol=1e-6)
    assert trl_utils._use_triton(torch.device("cpu")) and trl_utils._use_triton.trl_decision is trl_own


def test_compiled_layers_train_to_the_same_loss(monkeypatch):
    import torch._inductor.config

    # scalar C++ kernels: the layers still go through dynamo, AOT autograd and inductor's codegen,
    # in half the compile time (inductor's vectoriser is PyTorch's to test, not the wiring here)
    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", False)
    config = load("finetune.method=full", "train.torch_compile=true")
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1)
    assert run.kernels.compile_layers
    compiled = model_module.load_model(config, run, device="cpu")
    plain = model_module.load_model(config, with_kernels(run, compile_layers=False), device="cpu")
    layers = compiled.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert all(layer._compiled_call_impl is None for layer in plain.model.layers)
    ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (compiled, plain):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append((loss.detach(), model.model.layers[0].mlp.up_proj.weight.grad.clone()))
    torch.testing.assert_close(losses[0][0], losses[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(losses[0][1], losses[1][1], rtol=1e-3, atol=1e-5)


def test_expandable_segments_are_set_before_cuda_starts(monkeypatch):
    """PyTorch reads PYTORCH_CUDA_ALLOC_CONF when CUDA starts, which forming the process group
    does: the setting must be in the environment when PartialState is created, and only on CUDA."""
    from sft_play import train as train_flow
    from sft_play.run import Placement

    seen = []
    monkeypatch.setattr(train_flow, "PartialState", lambda **kwargs: seen.append(
        (kwargs, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    train_flow.start_processes(load("train.expandable_segments=true"), Placement(on_cuda=True))
    assert seen[-1][1] == "max_split_size_mb:512,expandable_segments:True"
    assert seen[-1][0]["cpu"] is False

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    train_flow.start_processes(load("train.expandable_segments=true"), Placement(on_cuda=False))
    assert seen[-1][1] == "" and seen[-1][0]["cpu"] is True  # no CUDA: nothing to set
    run = resolve(load("train.expandable_segments=true"), on_cuda=True, bf16_supported=True, world_size=1)
    assert run.kernels.expandable_segments  # what the plan's notes read


def test_every_lever_the_throughput_bench_measures_is_a_valid_switch(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from throughput import LEVERS

    assert set(LEVERS) == {"flex", "compile", "liger", "expandable"}
    for lever, overrides in LEVERS.items():
        if lever == "liger" and importlib.util.find_spec("liger_kernel") is None:
            with pytest.raises(config_module.ConfigError):
                load(*overrides)
            continue
        config = load(*overrides)
        run = resolve(config, on_cuda=True, bf16_supported=True, world_size=1)
        assert run != resolve(load(), on_cuda=True, bf16_supported=True, world_size=1), lever  # it changes the run
