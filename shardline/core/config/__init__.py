"""The one config file: typed models, `extends:` chains, `--set` overrides, validation up front.

Everything a run does is decided by a `PipelineConfig`. It is parsed from YAML, checked before any
work starts (an error names the key, the bad value and what is allowed), and the *resolved* config
(after `extends` and `--set`) is what gets hashed, logged and stored. Its parts: `base` (the error, the strict
model, the stable hash), `data` (`data:`), `schema` (the other sections and `PipelineConfig`), `metric_names`,
`load` (YAML, `extends`, `--set`), `settings` (the `SHARDLINE_*` environment).
"""

from shardline.core.config.base import (  # noqa: F401
    FILE_SEQUENCE,
    SPLITS,
    ConfigError,
    stable_hash,
)
from shardline.core.config.data import (  # noqa: F401
    DataConfig,
    SplitConfig,
    TokenizerConfig,
    training_splits,
)
from shardline.core.config.load import (  # noqa: F401
    apply_overrides,
    code_beside,
    key_problem,
    load_config,
    read_yaml,
    validate_config,
)
from shardline.core.config.metric_names import (  # noqa: F401
    CLASSIFICATION_METRICS,
    REGRESSION_METRICS,
    is_ranking_validation,
    metric_directions,
    metric_key,
    ranking_metrics_of,
    resolve_selection,
    validation_metrics,
    validation_name,
    validation_ranking_names,
)
from shardline.core.config.schema import (  # noqa: F401
    ComputeConfig,
    MlflowConfig,
    ModelConfig,
    PipelineConfig,
    TrainingConfig,
)
