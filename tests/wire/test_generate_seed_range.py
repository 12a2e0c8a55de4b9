"""A `/generate` sampling seed beyond what torch's generators take is a 400 naming the field (before: the
engine's `manual_seed` overflowed and the 400 named no field)."""

import pytest

from stacx.wire.sglang_protocol import SEED_MAX, parse_sampling_params


def test_a_seed_beyond_the_generators_range_is_refused_naming_the_field():
    assert parse_sampling_params({"max_new_tokens": 2, "sampling_seed": SEED_MAX}).seed == SEED_MAX
    with pytest.raises(ValueError, match=r"/generate: 'sampling_params.sampling_seed' must be <= 18446744073709551615, "
                                         r"got 1180591620717411303424"):
        parse_sampling_params({"max_new_tokens": 2, "sampling_seed": 2**70})
    with pytest.raises(ValueError, match=r"'sampling_params.max_new_tokens' must be <= "):
        parse_sampling_params({"max_new_tokens": 2**70})
