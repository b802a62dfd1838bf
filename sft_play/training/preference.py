"""Preference tuning with TRL's ``DPOTrainer``, as the run decided it: its arguments beside the
SFT ones (:func:`dpo_settings`), and the trainer class over pairs that
:mod:`sft_play.data.preference` has tokenised already."""

from __future__ import annotations

from typing import Any

from sft_play.config import RunConfig, preference_losses
from sft_play.run import BatchSplit, Run


def dpo_settings(config: RunConfig, run: Run, batch: BatchSplit) -> dict[str, Any]:
    """``DPOConfig``'s own fields for the run: the loss, the reference's log-probs, the pairs'
    length (TRL's collator cuts a pair's answers at ``max_length``, keeping its start)."""
    pref = config.preference
    losses, weights = preference_losses(config)
    precomputed = run.preference is not None and run.preference.reference == "precomputed"
    return dict(
        beta=pref.beta,
        loss_type=losses,
        loss_weights=weights,
        label_smoothing=pref.label_smoothing,
        precompute_ref_log_probs=precomputed,
        precompute_ref_batch_size=(pref.precompute_batch_size or batch.micro_batch_size) if precomputed else None,
        max_length=config.data.max_seq_length,
        truncation_mode="keep_start",
    )


def trainer_class() -> type:
    """TRL's ``DPOTrainer`` as the run uses it: it takes the pairs as tokenised, writes no model
    card into checkpoints, keeps a reference log-prob column it was given, and, on a rebuild of the
    run's own adapter (an out-of-memory backoff), keeps the base as the reference instead of
    the copy of the trained adapter TRL would make."""
    from trl import DPOTrainer

    class PreferenceTrainer(DPOTrainer):
        def __init__(self, *args: Any, own_adapter: bool = False, **kwargs: Any):
            super().__init__(*args, **kwargs)
            # TRL copies an adapter it is given into a frozen "ref" one (to continue a trained
            # adapter); this one is the run's own, whose reference is the base
            if own_adapter and "ref" in getattr(self.model, "peft_config", {}):
                self.model.delete_adapter("ref")

        def create_model_card(self, *args: Any, **kwargs: Any) -> None:
            return None

        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            if "prompt_ids" in getattr(dataset, "column_names", ()):  # sft_play.data.preference's
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

        def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
            # a rebuild is given the first trainer's data, scored before any training; the model
            # it would score now has trained
            if "ref_chosen_logps" in getattr(dataset, "column_names", ()):
                return dataset
            return super()._precompute_ref_logps(dataset, name, batch_size)

    PreferenceTrainer.__name__ = PreferenceTrainer.__qualname__ = "PreferenceTrainer"
    return PreferenceTrainer
