"""Run configuration: typed sections (:mod:`.schema`), YAML loading with ``key=value``
overrides (:mod:`.loading`, :mod:`.overrides`), the wording of every problem
(:mod:`.messages`), what a config needs from the machine (:mod:`.environment`: files and
packages) and the generated reference (:mod:`.reference`).

A run config is a YAML file whose top-level keys are the sections (``model``, ``finetune``,
``lora``, ``preference``, ``quantization``, ``data``, ``train``, ``distributed``, ``planner``). Every script
takes ``--config PATH`` plus any number of ``section.key=value`` overrides with the same dotted
names. :func:`load` validates everything it can without touching weights or the network and
reports every problem at once (:class:`ConfigError`): unknown keys name the nearest valid key,
bad values name the allowed values, missing files name the path.

Nothing here imports torch or transformers, so every script can use it, ``make check`` too.
"""

from sft_play.config.loading import as_built, load
from sft_play.config.overrides import parse_override
from sft_play.config.reference import reference_markdown
from sft_play.config.schema import (SECTIONS, ConfigError, DataConfig, DistributedConfig, FinetuneConfig, LoraConfig,
                                    REFERENCE_FREE, ModelConfig, PlannerConfig, PreferenceConfig, QuantizationConfig,
                                    RunConfig, TrainConfig, consistency_problems, kto_estimates_kl, loss_types,
                                    preference_losses, sequence_split_problem, valid_keys)

__all__ = [
    "SECTIONS", "ConfigError", "as_built", "DataConfig", "DistributedConfig", "FinetuneConfig", "LoraConfig", "ModelConfig",
    "PlannerConfig", "PreferenceConfig", "QuantizationConfig", "REFERENCE_FREE", "RunConfig", "kto_estimates_kl", "loss_types", "TrainConfig", "load", "parse_override",
    "reference_markdown", "consistency_problems", "preference_losses", "sequence_split_problem", "valid_keys",
]
