"""The seed chat workload generator: CPython-exact randomness and the seed's request stream."""

import random

import kvroute
import numpy as np
import pytest
from kvroute.sim import seed_chat


def python_seed_workload(rate, seconds, seed=0, systems=20, system_tokens=2048, conversations=400, turn_tokens=300):
    """The seed's ``workload()``, verbatim apart from the shape parameters."""
    rng = random.Random(seed)
    sys_prompts = [[rng.randrange(10**6) for _ in range(system_tokens)] for _ in range(systems)]
    convs = [list(rng.choice(sys_prompts)) for _ in range(conversations)]
    t, reqs = 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        c = rng.randrange(len(convs))
        convs[c] = convs[c] + [rng.randrange(10**6) for _ in range(turn_tokens)]
        reqs.append((t, list(convs[c])))
    return reqs


@pytest.mark.parametrize("rate,seconds,seed", [(20, 10, 0), (70, 3, 5), (3.5, 30, 12345), (50, 2, 2**40 + 7)])
def test_requests_are_the_seeds_own(rate, seconds, seed):
    ref = python_seed_workload(rate, seconds, seed, systems=5, system_tokens=256, conversations=40, turn_tokens=70)
    w = seed_chat(rate, seconds, seed, systems=5, system_tokens=256, conversations=40, turn_tokens=70, with_tokens=True)
    assert len(w) == len(ref)
    for i, (t, tokens) in enumerate(ref):
        assert w.arrival[i] == t  # bit-exact, not approximately
        conv = w.meta["conversation_tokens"][w.meta["conversation"][i]]
        assert w.num_tokens[i] == len(tokens)
        assert conv[: len(tokens)].tolist() == tokens
        assert np.array_equal(w.request_hashes(i), kvroute.block_hashes(np.asarray(tokens, dtype=np.uint32), 64))


def test_seed_request_counts():
    # The seed prints these counts for its 120 s runs.
    assert len(seed_chat(40, 120)) == 4814
    assert len(seed_chat(70, 120)) == 8456


def test_full_size_stream_matches_python_on_a_prefix():
    ref = python_seed_workload(70, 1.0)
    w = seed_chat(70, 1.0, with_tokens=True)
    assert [t for t, _ in ref] == w.arrival.tolist()
    assert [len(x) for _, x in ref] == w.num_tokens.tolist()


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="rate"):
        seed_chat(0, 10)
    with pytest.raises(ValueError, match="seconds"):
        seed_chat(10, float("nan"))
    with pytest.raises(ValueError, match="seed"):
        seed_chat(10, 1, seed=-1)
    with pytest.raises(ValueError, match="conversations"):
        seed_chat(10, 1, conversations=0)
