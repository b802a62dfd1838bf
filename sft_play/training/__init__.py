"""Training with TRL's ``SFTTrainer``, in rooms of one concern:

  arguments.py  the trainer's arguments from the resolved run (SFTConfig, DeepSpeed, FSDP2)
  trainer.py    the trainer factory: SFTTrainer with our callbacks, LoRA+
  backoff.py    what changes the batch split under way: calibration, out-of-memory backoff
  saving.py     the final model (FSDP2's shards gathered), the ranks' fingerprint, the summary

``sft_play.train`` runs them in order; the run folder's files are written by
:mod:`sft_play.run_folder`.
"""

from sft_play.training.arguments import (accelerator_settings, deepspeed_config, fsdp_mixed_precision, fsdp_settings,
                                         shard_on_cpu, trainer_arguments)
from sft_play.training.backoff import calibrate, measure_peaks, train_with_backoff
from sft_play.training.saving import (loss_history, save_final_model, summary_of, weights_fingerprint,
                                      write_failure)
from sft_play.training.trainer import LoraPlus, trainer_factory

__all__ = [
    "LoraPlus", "accelerator_settings", "calibrate", "deepspeed_config", "fsdp_mixed_precision", "fsdp_settings",
    "loss_history", "measure_peaks", "save_final_model", "trainer_arguments", "shard_on_cpu",
    "summary_of", "train_with_backoff", "trainer_factory", "weights_fingerprint",
    "write_failure",
]
