"""The rollout worker's translation of a request record into an engine request (``kv_moved``: the rule that
decides whether a resume may take its KV instead of a prefill)."""

from __future__ import annotations

import numpy as np
import pytest

from dora_rl.producers.rollout.requests import gen_request
from dora_rl.schemas.records import RolloutRequest


def _request(partial: list[int], versions: list[int] | None) -> RolloutRequest:
    return RolloutRequest(run_id="r", trajectory_id="r/p0/0", group_id="r/p0", prompt_id="p0", sample_index=0,
                          group_size=2, policy_version=3, instance_id="rollout-1", action="GENERATE", task="t",
                          reference="", prompt_ids=np.array([1, 2]), partial_ids=np.array(partial, dtype=np.int32),
                          partial_logprobs=np.full(len(partial), -0.5, dtype=np.float32), max_new_tokens=8,
                          partial_versions=None if versions is None else np.array(versions, dtype=np.int64))


@pytest.mark.parametrize(("partial", "versions", "moved"), [
    ([7, 8], None, True),  # DORA's resume: no per-token versions means every token is policy_version's
    ([7, 8], [3, 3], True),  # the partial baseline, resumed under the version that wrote it
    ([7, 8], [2, 3], False),  # written partly by an older version: its KV is not this version's
    ([7, 8], [3], False),  # a malformed record: versions do not cover the tokens
    ([], None, False),  # a fresh request moves nothing
])
def test_kv_moved_only_when_every_partial_token_is_the_requests_version(
        partial: list[int], versions: list[int] | None, moved: bool) -> None:
    req = gen_request(_request(partial, versions))
    assert req.kv_moved is moved
    assert req.partial_ids == partial and req.max_new_tokens == 8
