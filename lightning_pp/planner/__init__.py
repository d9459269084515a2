"""``lightning-pp plan --search``: profile a model, search pipeline shapes, recommend one.

- :mod:`.profile`: :class:`ModelProfile` / :class:`LayerCost`, JSON save/load.
- :mod:`.profiler`: measure a model's layers on this process's device (cached).
- :mod:`.memory`: predicted peak memory per rank.
- :mod:`.sharding`: the training states' bytes under ``zero``/``fsdp`` (the formulas).
- :mod:`.meta_profile`, :mod:`.plan_memory`: a plan's memory from the meta-device model (the
  dry run of ``lightning-pp plan``).
- :mod:`.search`: enumerate, simulate, rank.
- :mod:`.verify`: run shapes in spawned worlds, compare with the prediction, calibrate the
  engine overhead and hop latency (imported on use: it spawns processes).

Example::

    prof = ModelProfile.load("profile.json")
    result = search(prof, world=4, global_batch=64, memory_per_device=8 * 2**30)
    print(format_table(result.ranked[:5]))

See docs/planner.md.
"""

from .memory import OPTIMIZER_BYTES, RankMemory, rank_memory
from .profile import LayerCost, ModelProfile
from .report import chosen_config, format_table
from .search import Candidate, Prediction, SearchError, SearchResult, SearchSpace, predict, search
from .sharding import ShardedState, Sharding, StateBytes, rank_state_bytes, sharded_state_bytes

__all__ = [
    "OPTIMIZER_BYTES",
    "Candidate",
    "LayerCost",
    "ModelProfile",
    "Prediction",
    "RankMemory",
    "SearchError",
    "SearchResult",
    "SearchSpace",
    "ShardedState",
    "Sharding",
    "StateBytes",
    "chosen_config",
    "format_table",
    "predict",
    "rank_memory",
    "rank_state_bytes",
    "search",
    "sharded_state_bytes",
]
