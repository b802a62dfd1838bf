"""The memory levers for long rows (sft_play.long_rows) compute what the plain path computes:
tiled MLPs and hidden states kept in host memory give the same losses and gradients, and they
act (tiles are computed, hidden states are packed off the device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sft_play import config as config_module
from sft_play import long_rows
from tests.conftest import FORKED, PINNED

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_model"


def _model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY), dtype=torch.float32)


def _step(model, ids: torch.Tensor, context=None) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with context if context is not None else torch.enable_grad():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_tiled_mlps_compute_the_plain_gradients_tile_by_tile():
    ids = torch.randint(0, 512, (2, 300))  # 300 tokens over a hidden size of 128: 3 tiles
    plain_loss, plain = _step(_model(), ids)
    model = _model()
    layers = model.model.layers
    assert long_rows.tile_mlps(layers, 128) == len(layers) == 4
    assert long_rows.tile_mlps(layers, 128) == 0  # once
    calls = []
    untiled = layers[0].mlp._sft_play_untiled_forward
    layers[0].mlp._sft_play_untiled_forward = lambda x: (calls.append(x.shape[-2]), untiled(x))[1]
    loss, grads = _step(model, ids)
    # three tiles in forward ([2, 100, 128] each), three again in backward (of the 2 x 300 rows flattened)
    assert calls == [100, 100, 100, 200, 200, 200]
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert grads.keys() == plain.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_checkpointed_hidden_states_are_kept_off_the_device_and_change_nothing():
    ids = torch.randint(0, 512, (2, 64))
    reference = _model()
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain_loss, plain = _step(reference, ids)

    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    packed = []
    offload = long_rows.OffloadedHiddenStates(128)
    pack, unpack = offload.pack_hook, offload.unpack_hook
    offload.pack_hook = lambda t: (lambda p: (packed.append(isinstance(p, tuple)), p)[1])(pack(t))
    loss, grads = _step(model, ids, offload)
    # each checkpointed layer's input and the final norm's, [2, 64, 128]: off the device
    assert sum(packed) >= 4 + 1, packed
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert unpack is offload.unpack_hook


@pytest.mark.slow
def test_a_run_with_both_levers_trains_to_the_plain_runs_losses(tmp_path):
    def run(name: str, *levers: str) -> list:
        done = subprocess.run(
            [sys.executable, "scripts/train_distributed.py", "--config", "configs/run_tiny.yaml", *PINNED,
             "train.max_steps=2", "train.logging_steps=1", "train.tensorboard=false", "lora.dropout=0",
             "train.gradient_checkpointing=true", f"train.output_dir={tmp_path}", f"train.run_name={name}", *levers],
            cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **FORKED})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((tmp_path / name / "summary.json").read_text())["losses"]

    plain = run("plain")
    levers = run("levers", "train.tiled_mlp=true", "train.offload_activations=true")
    assert [step for step, _ in levers] == [step for step, _ in plain] == [1, 2]
    for (_, ours), (_, theirs) in zip(levers, plain):
        assert ours == pytest.approx(theirs, rel=1e-5)
    saved = config_module.load(tmp_path / "levers" / "config.yaml", check_paths=False)
    assert saved.train.tiled_mlp and saved.train.offload_activations


def test_a_long_packed_row_is_batched_without_a_quadratic_mask():
    """Rows go to the model as position ids; no [s, s] mask is built on the host (the attention
    kernel's, or transformers' on the device, is the planner's business): here two rows of
    131,072 tokens, eight examples each, in linear memory."""
    import tracemalloc

    from sft_play.data.collate import PackedRowsCollator

    tokens = 131072
    row = {"input_ids": list(range(tokens)), "labels": list(range(tokens)), "seq_lengths": [tokens // 8] * 8}
    tracemalloc.start()
    try:
        batch = PackedRowsCollator(pad_token_id=0)([row, row])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["position_ids"].shape == (2, tokens) and int(batch["position_ids"][0, tokens // 8]) == 0
    assert peak < 200 * 2 * tokens, f"{peak / 2**20:.0f} MiB for two rows"  # an [s, s] mask would be 16 GiB


def test_tiles_are_made_in_a_process_that_skipped_deepspeed():
    """A training process skips DeepSpeed's import when its strategy does not use it
    (sft_play.lean_imports); a remedy or plan with tiled MLPs made there still needs it: the
    tiling took it as absent (ModuleNotFoundError)."""
    script = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "from sft_play import long_rows\n"
        f"model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({str(TINY)!r}))\n"
        "print(long_rows.tile_mlps(model.model.layers, 128))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "4", done.stderr[-2000:]


def test_mixture_of_experts_blocks_are_left_whole():
    """A Mixtral block reshapes its input to rows and routes per call: tiled, it failed in forward
    (a non-contiguous tile's view) and in backward (flattened tiles)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(REPO / "tests" / "fixtures" / "model_configs" / "tiny-mixtral")
    model = AutoModelForCausalLM.from_config(config)
    assert long_rows.tile_mlps(model.model.layers, config.hidden_size) == 0
    ids = torch.randint(0, config.vocab_size, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()  # untouched, it trains


def test_ranks_agree_on_the_most_tiles_any_of_them_needs():
    """Under ZeRO-3 every tile gathers the parameters again: ranks of different row lengths must
    make the same number of tiles, or they wait for each other forever. Two gloo processes. (A
    ZeRO-2 run with tiled MLPs on two CPU ranks trained to the untiled run's losses by hand,
    2026-11-27; make train-deepspeed, 3 steps.)"""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = ("import os, torch, torch.distributed as dist\n"
              "from sft_play import long_rows\n"
              "dist.init_process_group('gloo')\n"
              "rank = dist.get_rank()\n"
              "print(long_rows._agreed(long_rows.tile_count([300, 1000][rank], 128), torch.device('cpu')))\n"
              "print(long_rows._agreed(5, torch.device('meta')))\n"  # the planner's trace in a training process
              "dist.destroy_process_group()\n")
    ranks = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                              "RANK": str(rank), "WORLD_SIZE": "2", "PYTHONPATH": str(REPO)})
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    # 3 tiles on one, 8 on the other: 8 on both; a trace on the meta device asks no one (it failed: .item() on meta)
    assert [out.split() for out, _ in outputs] == [["8", "5"], ["8", "5"]], outputs


def test_tiled_mlps_under_ddp_on_several_processes_are_refused_before_anything_starts():
    done = subprocess.run([sys.executable, "scripts/launch.py", "--launcher", "accelerate", "--cpu", "--num-gpus", "2",
                           "--config", "configs/run_tiny.yaml", "train.tiled_mlp=true"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **FORKED})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: train.tiled_mlp: DDP reduces a weight's gradient at the first tile's backward; several processes "
        "train tiled MLPs under DeepSpeed ZeRO: make train-deepspeed"]
