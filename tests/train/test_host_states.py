"""Per-shard data positions in the checkpoint."""

import json

import pytest

from upcycle.train import host_states


def test_positions_round_trip_through_json_per_shard():
  state = {'pipeline': {'kind': 'text'}, 'seed': 3, 'shard_index': 0, 'epoch': 1,
           'batch_in_epoch': 7, 'batches': 20}
  other = dict(state, shard_index=1, batch_in_epoch=6)
  saved = json.loads(json.dumps(host_states.gather({0: state, 1: other})))
  assert saved == {'shards': {'0': state, '1': other}}
  assert host_states.mine(saved, [0, 1]) == {0: state, 1: other}
  assert host_states.mine(saved, [1]) == {1: other}


def test_a_checkpoint_from_another_shard_layout_is_refused():
  with pytest.raises(ValueError, match=r"data shards \['1', '2'\], not for shard\(s\) \[0\]"):
    host_states.mine({'shards': {'1': {}, '2': {}}}, [0])
