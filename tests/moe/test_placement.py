import pytest

from upcycle.moe import sparse_layer_indices


@pytest.mark.parametrize('placement,expected', [
    ('every_other', (1, 3, 5)),
    ('all', (0, 1, 2, 3, 4, 5)),
    ('none', ()),
    ('last_2', (4, 5)),
    ('first_1', (0,)),
    ([5, 0, 3], (0, 3, 5)),
])
def test_placements(placement, expected):
  assert sparse_layer_indices(placement, 6) == expected


@pytest.mark.parametrize('placement,message', [
    ('every_third', 'not understood'),
    ('last_7', 'asks for 7 layers; the stack has 6'),
    ([2, 6], r'names layers \[6\] outside 0..5'),
])
def test_bad_placements_say_what_is_wrong(placement, message):
  with pytest.raises(ValueError, match=message):
    sparse_layer_indices(placement, 6)
