"""``dora-rl replay``: re-run a recorded run from its topics alone (or from an archive of them).

Verbs (docs/decisions/0020): ``dump`` (:mod:`.dump`, the default: records as JSON lines), ``retrain``
(:mod:`.retrain`: re-execute a step from a checkpoint and the recorded batches, bit-identical on CPU),
``rescore`` (:mod:`.rescore`: another reward function, per-group diff of rewards and advantages),
``refeed`` (:mod:`.refeed`: a new run trained on the recorded trajectories, with provenance),
``export`` (:mod:`.export`: filtered Parquet with the schema docs on the columns) and ``archive``
(:mod:`.archive`: the run as Parquet files, readable by every verb via ``--from-archive``). Every verb
reads through a :class:`~.source.RecordSource`, which refuses records retention deleted.
"""

from .dump import dump, replay, to_jsonable

__all__ = ["dump", "replay", "to_jsonable"]
