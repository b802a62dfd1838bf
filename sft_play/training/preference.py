"""Preference tuning with TRL's ``DPOTrainer`` (``KTOTrainer`` for KTO), as the run decided it:
its arguments beside the SFT ones (:func:`dpo_settings`, :func:`kto_settings`), and the trainer
class over pairs (or labelled answers) that :mod:`sft_play.data.preference` has tokenised already.

ORPO and SimPO score the policy alone. TRL has them as ``ORPOTrainer`` and ``CPOTrainer``
(``trl.experimental``), which tokenise text themselves and materialise the b x s x V logits; here
they run on the DPO trainer's step (the pairs as prepared, its fused head, which the planner
traces and the CPU ground truth checks), with TRL's own loss functions from those trainers."""

from __future__ import annotations

import contextlib
from typing import Any

from sft_play import patches
from sft_play.config import REFERENCE_FREE, RunConfig, loss_types, preference_losses
from sft_play.run import BatchSplit, Run


def dpo_settings(config: RunConfig, run: Run, batch: BatchSplit) -> dict[str, Any]:
    """``DPOConfig``'s own fields for the run: the loss, the reference's log-probs, the pairs'
    length (TRL's collator cuts a pair's answers at ``max_length``, keeping its start)."""
    pref = config.preference
    losses, weights = preference_losses(config) if config.finetune.objective not in REFERENCE_FREE else (["sigmoid"],
                                                                                                          None)
    precomputed = run.preference is not None and run.preference.reference == "precomputed"
    return dict(
        beta=pref.beta,
        loss_type=losses,
        loss_weights=weights,
        label_smoothing=pref.label_smoothing,
        precompute_ref_log_probs=precomputed,  # (never for orpo and simpo: their reference is "none")
        precompute_ref_batch_size=(pref.precompute_batch_size or batch.micro_batch_size) if precomputed else None,
        max_length=config.data.max_seq_length,
        truncation_mode="keep_start",
    )


def kto_settings(config: RunConfig, run: Run, batch: BatchSplit) -> dict[str, Any]:
    """``KTOConfig``'s own fields for the run: the loss, the weights of each side, the
    reference's log-probs, the answers' length (TRL's collator cuts a row at ``max_length``)."""
    pref = config.preference
    precomputed = run.preference is not None and run.preference.reference == "precomputed"
    return dict(
        beta=pref.beta,
        loss_type=loss_types(pref, "kto")[0],
        desirable_weight=pref.desirable_weight,
        undesirable_weight=pref.undesirable_weight,
        precompute_ref_log_probs=precomputed,
        precompute_ref_batch_size=(pref.precompute_batch_size or batch.micro_batch_size) if precomputed else None,
        max_length=config.data.max_seq_length,
    )


def trainer_class(config: RunConfig) -> type:
    """TRL's ``DPOTrainer`` as the run uses it: it takes the pairs as tokenised, writes no model
    card into checkpoints, keeps a reference log-prob column it was given, and, on a rebuild of the
    run's own adapter (an out-of-memory backoff), keeps the base as the reference instead of
    the copy of the trained adapter TRL would make. For ORPO and SimPO it keeps no reference and
    computes their loss (:func:`reference_free_loss`)."""
    from trl import DPOTrainer

    objective, pref = config.finetune.objective, config.preference
    if objective == "kto":
        return _kto_trainer_class()

    class PreferenceTrainer(DPOTrainer):
        def __init__(self, *args: Any, own_adapter: bool = False, **kwargs: Any):
            with patches.no_reference_loading() if objective in REFERENCE_FREE else contextlib.nullcontext():
                super().__init__(*args, **kwargs)
            # TRL copies an adapter it is given into a frozen "ref" one (to continue a trained
            # adapter); this one is the run's own, whose reference is the base
            if own_adapter and "ref" in getattr(self.model, "peft_config", {}):
                self.model.delete_adapter("ref")
            if objective == "simpo":  # what TRL's CPO loss reads of its trainer, SimPO's
                self.loss_type, self.simpo_gamma, self.alpha, self.cpo_alpha = ("simpo", pref.simpo_gamma, 0.0,
                                                                                pref.sft_weight)

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

        def _compute_loss(self, model: Any, inputs: dict, return_outputs: bool) -> Any:
            if objective in REFERENCE_FREE:
                return reference_free_loss(self, objective, model, inputs, return_outputs)
            return super()._compute_loss(model, inputs, return_outputs)

    PreferenceTrainer.__name__ = PreferenceTrainer.__qualname__ = "PreferenceTrainer"
    return PreferenceTrainer


def _kto_trainer_class() -> type:
    """TRL's ``KTOTrainer`` as the run uses it (as :func:`trainer_class` does ``DPOTrainer``): it
    takes the answers as tokenised and adds only their KL column, which pairs each answer's prompt
    with the previous answer of its micro-batch (TRL's own rotation; an out-of-memory rebuild
    keeps the first trainer's, which its precomputed reference log-probs were scored on)."""
    from trl import KTOTrainer

    class PreferenceTrainer(KTOTrainer):
        def __init__(self, *args: Any, own_adapter: bool = False, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if own_adapter and "ref" in getattr(self.model, "peft_config", {}):
                self.model.delete_adapter("ref")

        def create_model_card(self, *args: Any, **kwargs: Any) -> None:
            return None

        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            if "completion_ids" not in getattr(dataset, "column_names", ()):  # not sft_play.data.preference's
                return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            if not self.calculate_KL or "KL_completion_ids" in dataset.column_names:
                return dataset

            def rotated(examples: dict[str, list]) -> dict[str, list]:
                examples["KL_completion_ids"] = [examples["completion_ids"][-1]] + examples["completion_ids"][:-1]
                return examples

            return dataset.map(rotated, batched=True, batch_size=args.per_device_train_batch_size)

        def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
            if "ref_logps" in getattr(dataset, "column_names", ()):  # a rebuild's: scored before training
                return dataset
            return super()._precompute_ref_logps(dataset, name, batch_size)

    PreferenceTrainer.__name__ = PreferenceTrainer.__qualname__ = "PreferenceTrainer"
    return PreferenceTrainer


def reference_free_loss(trainer: Any, objective: str, model: Any, inputs: dict, return_outputs: bool) -> Any:
    """ORPO's or SimPO's loss of a batch of pairs (chosen rows, then rejected ones), from the
    policy's average log-prob of each answer through TRL's fused head, by TRL's own functions:
    ``ORPOTrainer.odds_ratio_loss`` beside the chosen answers' NLL (mean over their tokens, as its
    cross-entropy), ``CPOTrainer.cpo_loss`` with SimPO's loss type (plus ``cpo_alpha`` x that NLL:
    CPO-SimPO). Logs the rewards as those trainers do (beta x the average log-prob)."""
    import warnings

    with warnings.catch_warnings():  # (that trl.experimental's APIs may change: pinned here, and tested)
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOTrainer
        from trl.experimental.orpo import ORPOTrainer

    mode = "train" if trainer.model.training else "eval"
    kwargs = {k: v for k, v in inputs.items() if k not in {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}}
    kwargs["use_cache"] = False
    if trainer.aux_loss_enabled:
        kwargs["output_router_logits"] = True
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    outputs = model(**kwargs, labels=labels, fused_lm_head=True)
    answer = inputs["completion_mask"][..., 1:]
    per_token = outputs.log_probs[:, -answer.size(1):] * answer
    tokens = answer.sum(dim=1)
    average = per_token.sum(dim=1) / tokens.clamp(min=1)
    chosen, rejected = average.chunk(2, dim=0)
    chosen_tokens = tokens.chunk(2, dim=0)[0].sum()
    nll = -per_token.chunk(2, dim=0)[0].sum() / chosen_tokens.clamp(min=1)
    metrics = trainer._metrics[mode]
    if objective == "orpo":
        losses, chosen_rewards, rejected_rewards, ratio, log_odds = ORPOTrainer.odds_ratio_loss(trainer, chosen, rejected)
        loss = nll - losses.mean()
        metrics["log_odds_ratio"].append(trainer.accelerator.gather_for_metrics(ratio).mean().item())
        metrics["log_odds_chosen"].append(trainer.accelerator.gather_for_metrics(log_odds).mean().item())
    else:
        losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(trainer, chosen, rejected)
        loss = losses.mean() + (trainer.cpo_alpha * nll if trainer.cpo_alpha else 0.0)
    if trainer.aux_loss_enabled:
        loss = loss + trainer.router_aux_loss_coef * outputs.aux_loss
    gather = trainer.accelerator.gather_for_metrics
    metrics["nll_loss"].append(gather(nll.detach()).mean().item())
    metrics["rewards/chosen"].append(gather(chosen_rewards).mean().item())
    metrics["rewards/rejected"].append(gather(rejected_rewards).mean().item())
    metrics["rewards/accuracies"].append(gather((chosen_rewards > rejected_rewards).float()).mean().item())
    metrics["rewards/margins"].append(gather(chosen_rewards - rejected_rewards).mean().item())
    metrics["logps/chosen"].append(gather(chosen.detach()).mean().item())
    metrics["logps/rejected"].append(gather(rejected.detach()).mean().item())
    if mode == "train":
        trainer._total_train_tokens += int(gather(inputs["attention_mask"].sum()).sum().item()) // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]
    return (loss, outputs) if return_outputs else loss
