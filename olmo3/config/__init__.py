"""Frozen configuration dataclasses. Every config validates itself at construction
(olmo3.config_checks, the checker): each field's value is checked against its annotation (bools
are bools, ints ints, floats finite numbers, enums members, tuples tuples), and every number
against the bounds its field declares (`bounded`, `resumable`); constraints between fields are
each class's `_check`. A bad value is a `ConfigError` naming `Class.field=value`.

One module per part of an experiment: `model` (ModelConfig, its presets), `data`, `training`
(optimizer, mesh, loop, checkpoints), `experiment` (evaluation, W&B, the Experiment). Every class
and enum is public here, as `olmo3.config.<Name>`: that is the name a run's config.json, a
pickle and Fiddle's serialization record, whichever module defines it, so moving a class between
these modules never breaks loading an existing run (launch/config_files.py admits the classes of
this package by that name).
"""

import enum as _enum
from typing import Any  # (annotations name it: type hints resolve in this namespace)

from olmo3.config_checks import ConfigError
from olmo3.config_checks import Validated as _Validated
from olmo3.config.data import DataConfig, LongDocuments, Packing, RepetitionFilter
from olmo3.config.experiment import (RULER_TASKS, EvalConfig, Experiment, RulerConfig,
                                     WandbConfig, WandbMode, resumable_fields)
from olmo3.config.model import (INT32_MAX, PRESETS, AttentionKernel, ContextParallel, DType,
                                ModelConfig, RopePositions, ScaledLayers, Yarn,
                                heads_split_problem, olmo3_7b,
                                olmo3_7b_long_context, olmo3_32b, olmo3_micro, olmo3_tiny)
from olmo3.config.training import (SEED_MAX, CheckpointConfig, InitMode, LossMean, MeshConfig,
                                   OptimizerConfig, Schedule, SpikeWindowOnRestart, TrainConfig)
from olmo3.config import data as _data, experiment as _experiment, model as _model
from olmo3.config import training as _training
from olmo3.remat import Remat  # (annotations name it)

# The one name of each class and enum (the module docstring): set once, here, for every one
# the four modules define, so none keeps its defining module's name (tests/test_config.py checks
# that each is also imported above and listed in __all__).
for _part in (_data, _experiment, _model, _training):
  for _cls in vars(_part).values():
    if (isinstance(_cls, type) and issubclass(_cls, (_Validated, _enum.Enum))
        and _cls.__module__ == _part.__name__):
      _cls.__module__ = __name__
del _part, _cls

__all__ = [
    "Any", "ConfigError", "Remat", "INT32_MAX", "SEED_MAX", "PRESETS", "resumable_fields",
    "olmo3_7b", "olmo3_7b_long_context", "olmo3_32b", "olmo3_micro", "olmo3_tiny",
    "DType", "AttentionKernel", "ContextParallel", "heads_split_problem", "ScaledLayers", "RopePositions", "Yarn",
    "ModelConfig",
    "RepetitionFilter", "LongDocuments", "Packing", "DataConfig", "Schedule",
    "SpikeWindowOnRestart", "OptimizerConfig", "MeshConfig", "LossMean", "TrainConfig", "InitMode",
    "CheckpointConfig", "RULER_TASKS", "RulerConfig", "EvalConfig", "WandbMode", "WandbConfig", "Experiment"]
