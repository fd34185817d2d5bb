"""Per-host data positions in the checkpoint."""

import json

import pytest

from upcycle.train import host_states


def test_positions_round_trip_through_json_per_host():
  state = {'pipeline': {'kind': 'text'}, 'seed': 3, 'shard_index': 0, 'epoch': 1,
           'batch_in_epoch': 7, 'batches': 20}
  saved = json.loads(json.dumps(host_states.gather(state)))
  assert saved == {'hosts': {'0': state}}
  assert host_states.mine(saved) == state


def test_a_checkpoint_from_another_host_layout_is_refused():
  with pytest.raises(ValueError, match=r"hosts \['1', '2'\], not for host 0"):
    host_states.mine({'hosts': {'1': {}, '2': {}}})
