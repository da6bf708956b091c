"""Windows over shards: a zero-copy view of a split, vectorised batch gathering, and a resumable loader.

A window is K consecutive rows [s, s+K) of one sequence segment; its target is the row
s + K - 1 + horizon (`last`), or each row's, s + k + horizon for k < K (`all`: a slice of the stored
target, as the window is of the features). A split has any number of targets (`target`, `target_1`, ...;
none for a model with its own loss). Windows are numbered across the split's shards in order (shard 0's windows
first), and that numbering is the "window order" every output of this package uses.

Its rooms: `batch` (a batch of windows, as tensors), `split` (a split's shards, opened and viewed), `loader`
(the resumable, shuffled training loader), `scored` (validation's pass, each target scored once).
"""

from shardline.trainer.data.batch import (  # noqa: F401
    LOADER_STATE_VERSION,
    Batch,
    portable,
    target_names,
)
from shardline.trainer.data.loader import (  # noqa: F401
    WindowLoader,
    check_cache_room,
)
from shardline.trainer.data.scored import (  # noqa: F401
    ScoredLoader,
)
from shardline.trainer.data.split import (  # noqa: F401
    ShardView,
    SplitData,
    open_split,
)
