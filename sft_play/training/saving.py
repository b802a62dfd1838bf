"""The end of training: the final model (gathered from FSDP2's shards where it is sharded), the
weights' fingerprint that says whether the ranks stayed in step, and what the trainer did, for
``summary.json``."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any


def weights_fingerprint(model: Any) -> str:
    """A short digest of the trainable parameters' values (per-tensor float64 sums) as this rank
    holds them: equal on every rank when data-parallel training kept the replicas in step; under
    FSDP2, of this rank's shards (equal between runs that trained the same way)."""
    sums = [f"{name}:{_local(param).detach().double().sum().item():.12e}"
            for name, param in sorted(model.named_parameters()) if param.requires_grad]
    return hashlib.sha1(";".join(sums).encode()).hexdigest()[:16]


def _local(param: Any) -> Any:
    """This rank's part of a parameter: FSDP2's are DTensors holding a shard."""
    return param.to_local() if hasattr(param, "to_local") else param


def save_final_model(trainer: Any, model_dir: Path, weights_dtype: str | None = None) -> None:
    """Save the trained model (unwrapped: an adapter, or the full model) and the tokenizer.

    FSDP2's checkpoints are sharded; the model folder holds whole tensors, gathered from every
    rank's shard (collectives) and written by the main process, so that merge, generate and
    eval read it as any other: an adapter's trainable tensors only (not the frozen base, which
    would all land in the main process's memory), or the full model in `weights_dtype` (FSDP2
    trains fp32 copies of 16-bit weights; the folder keeps the dtype the run loaded, as DDP's
    does). The trainer also pickles its arguments beside them; the run's ``config.yaml``
    already says everything they would, and only safetensors and plain text belong in a model
    folder.
    """
    if getattr(trainer, "is_fsdp_enabled", False):
        _save_sharded(trainer, model_dir, weights_dtype)
    else:
        trainer.save_model(str(model_dir))
    if trainer.is_world_process_zero():
        (model_dir / "training_args.bin").unlink(missing_ok=True)


def _save_sharded(trainer: Any, model_dir: Path, weights_dtype: str | None) -> None:
    import torch

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(unwrapped, "peft_config"):  # an adapter: gather what trained, tensor by tensor
        state_dict = {}
        for name, param in trainer.model.named_parameters():
            if param.requires_grad:
                whole = param.full_tensor() if hasattr(param, "full_tensor") else param
                if trainer.is_world_process_zero():
                    state_dict[name] = whole.detach().cpu()
    else:
        state_dict = trainer.accelerator.get_state_dict(trainer.model)  # whole tensors, in CPU memory
        dtype = getattr(torch, weights_dtype) if weights_dtype else None
        if dtype is not None and state_dict:
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if trainer.is_world_process_zero():
        # the trainer's own writer of a given state dict (model, tokenizer), as its save_model uses it
        trainer._save(str(model_dir), state_dict=state_dict)
        config_file = model_dir / "config.json"
        if weights_dtype and not hasattr(unwrapped, "peft_config") and config_file.is_file():
            # save_pretrained writes the dtype of the fp32 parameters FSDP2 trained, not the tensors' own
            saved = json.loads(config_file.read_text())
            saved["dtype"] = weights_dtype
            config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    trainer.accelerator.wait_for_everyone()


_WRITERS = {"_save_checkpoint", "save_model", "save_final_model", "write_marker", "rotate"}


def write_failure(error: BaseException) -> str | None:
    """Why writing a checkpoint or the final model failed, when `error` says the filesystem
    refused it (no space, no permission, a read-only or immutable folder) and was raised while
    one was being written; None for anything else. The writers word it differently: an OSError
    (the trainer's own files), a SafetensorError (weights), torch.save's RuntimeError (optimizer
    state)."""
    frames, tb = set(), error.__traceback__
    while tb is not None:
        frames.add(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if not frames & _WRITERS:
        return None
    if isinstance(error, OSError):
        return f"{error.strerror or error}" + (f" ({error.filename})" if error.filename else "")
    text = str(error).strip()
    if type(error).__name__ == "SafetensorError" or "PytorchStreamWriter failed" in text:
        return text.splitlines()[-1][:300] if text else type(error).__name__
    return None


def loss_history(trainer: Any) -> list[tuple[int, float]]:
    """(step, training loss) for every logged step."""
    return [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e and math.isfinite(e["loss"])]


def summary_of(trainer: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """What the trainer did, as ``summary.json`` says it (:func:`sft_play.run_folder.write_summary`
    writes it), with `extra` after it."""
    losses = loss_history(trainer)
    final = next((e for e in reversed(trainer.state.log_history) if "train_runtime" in e), {})
    return {
        "global_step": trainer.state.global_step,
        "first_loss": losses[0][1] if losses else None,
        "last_loss": losses[-1][1] if losses else None,
        "last_eval_loss": next((e["eval_loss"] for e in reversed(trainer.state.log_history) if "eval_loss" in e), None),
        "losses": losses,
        "train_runtime_s": final.get("train_runtime"),  # with a resumed run's earlier segments, once written
        "segments": 1,
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "mixed_precision": str(trainer.accelerator.mixed_precision),  # what autocast really ran
        "distributed_type": str(trainer.accelerator.distributed_type).rsplit(".", 1)[-1],  # and how it shared the work
        **extra,
    }
