"""Sampler chain vs. a plain-Python reference of llama.cpp's semantics."""

import math

import numpy as np
import pytest

from edgeinfer.errors import EdgeInferError
from edgeinfer.sampling import (
    InvalidParameterError,
    SamplingParams,
    apply_penalties,
    filter_candidates,
    make_logits_processors,
    make_sampler,
    make_token_sampler,
    sample_argmax,
)


# ---------------------------------------------------------------------------
# Independent reference: sorted Python lists, loops, math.exp
# ---------------------------------------------------------------------------

def ref_filter(logits, top_k, top_p, min_p):
    """llama.cpp chain top_k -> top_p -> min_p written the obvious way; returns [(id, logit)]."""
    items = sorted(enumerate(float(x) for x in logits), key=lambda t: -t[1])
    if top_k > 0:
        items = items[:top_k]
    if top_p < 1.0:
        m = items[0][1]
        z = sum(math.exp(l - m) for _, l in items)
        kept, cum = [], 0.0
        for i, l in items:
            kept.append((i, l))
            cum += math.exp(l - m) / z
            if cum >= top_p:
                break
        items = kept
    if min_p > 0.0:
        m = items[0][1]
        items = [(i, l) for i, l in items if math.exp(l - m) >= min_p]
    return items


def ref_distribution(logits, temperature, top_k, top_p, min_p):
    items = ref_filter(logits, top_k, top_p, min_p)
    m = max(l for _, l in items)
    w = {i: math.exp((l - m) / temperature) for i, l in items}
    z = sum(w.values())
    return {i: v / z for i, v in w.items()}


def ref_penalties(logits, prev, repeat, presence, frequency, last_n):
    out = [float(x) for x in logits]
    window = prev if last_n < 0 else prev[len(prev) - last_n:] if last_n else []
    for tok in set(window):
        c = window.count(tok)
        out[tok] = out[tok] * repeat if out[tok] <= 0 else out[tok] / repeat
        out[tok] -= c * frequency + presence
    return out


def random_logits(n, seed, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


# ---------------------------------------------------------------------------
# Greedy and reproducibility
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_temperature_zero_is_argmax(seed):
    logits = random_logits(1000, seed)
    s = make_sampler(temperature=0.0, seed=seed)
    assert s(logits) == int(np.argmax(logits)) == sample_argmax(logits)


@pytest.mark.parametrize("temperature", [0.1, 0.8, 1.5, 10.0])
def test_top_k_1_is_greedy(temperature):
    s = make_sampler(temperature=temperature, top_k=1, top_p=1.0, min_p=0.0, seed=3)
    for seed in range(20):
        logits = random_logits(5000, seed, scale=0.5)  # flat: a real sampler would wander
        assert s(logits) == int(np.argmax(logits))


def test_same_seed_same_sequence_and_different_seed_differs():
    logits = random_logits(2000, 0, scale=0.3)
    kw = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a, b, c = make_sampler(seed=42, **kw), make_sampler(seed=42, **kw), make_sampler(seed=43, **kw)
    seq_a = [a(logits) for _ in range(50)]
    assert seq_a == [b(logits) for _ in range(50)]
    assert seq_a != [c(logits) for _ in range(50)]
    assert len(set(seq_a)) > 10   # not stuck on one token


# ---------------------------------------------------------------------------
# Filters keep exactly the reference set
# ---------------------------------------------------------------------------

FILTER_CASES = [
    # (vocab, scale, top_k, top_p, min_p)
    (50, 2.0, 40, 0.95, 0.05),       # llama.cpp defaults
    (50, 2.0, 0, 0.9, 0.0),
    (50, 2.0, 0, 1.0, 0.1),
    (50, 2.0, 10, 0.5, 0.0),
    (50, 2.0, 0, 0.3, 0.2),
    (3000, 0.05, 0, 0.9, 0.0),       # nearly flat: top-p prefix >> 256, exercises head growth
    (3000, 0.5, 0, 0.95, 0.0),
    (3000, 4.0, 0, 0.99, 0.0),       # peaked: prefix fits in the first 256-token head
    (3000, 1.0, 100, 0.8, 0.01),
    (3000, 1.0, 5000, 1.0, 0.0),     # k larger than vocab
    (3000, 20.0, 0, 0.999, 0.0),     # logits spread over > 40 nats
    (3000, 0.0, 0, 0.5003, 0.0),     # all equal: ties keep the lowest ids
]


@pytest.mark.parametrize("n,scale,top_k,top_p,min_p", FILTER_CASES)
@pytest.mark.parametrize("seed", range(3))
def test_filters_keep_reference_set(n, scale, top_k, top_p, min_p, seed):
    logits = random_logits(n, seed, scale)
    c = filter_candidates(logits, top_k, top_p, min_p)
    want = ref_filter(logits, top_k, top_p, min_p)
    assert sorted(c.ids.tolist()) == sorted(i for i, _ in want)
    np.testing.assert_array_equal(logits[c.ids], c.logits.astype(np.float32))
    if c.sorted:
        assert np.all(np.diff(c.logits) <= 0)


def test_masked_logits_are_never_kept():
    logits = random_logits(3000, 9, 0.5)
    logits[::3] = -np.inf
    for top_k, top_p, min_p in [(0, 0.95, 0.0), (0, 1.0, 0.01), (100, 0.9, 0.0), (0, 0.999999, 0.0)]:
        c = filter_candidates(logits, top_k, top_p, min_p)
        want = ref_filter(logits, top_k, top_p, min_p)
        assert sorted(c.ids.tolist()) == sorted(i for i, _ in want)
        assert np.all(np.isfinite(c.logits))


def test_top_p_full_vocab_matches_numpy_sort():
    # 262k vocab (Gemma 3): compare the partition-based path with one plain full sort.
    logits = random_logits(262_144, 7, scale=1.5)
    for p in (0.5, 0.95):
        c = filter_candidates(logits, 0, p, 0.0)
        x = np.sort(logits.astype(np.float64))[::-1]
        e = np.exp(x - x[0])
        cum = np.cumsum(e / e.sum())
        n_keep = int(np.argmax(cum >= p)) + 1
        assert c.ids.size == n_keep
        assert set(c.ids.tolist()) == set(np.argsort(-logits.astype(np.float64), kind="stable")[:n_keep].tolist())


def test_chain_order_is_top_p_before_min_p():
    # top_p then min_p keeps {0,1,2}: cum 0.5, 0.8, 0.94 reaches 0.85 at token 2; min_p
    # (>= 0.1) keeps all three. min_p first would drop token 3, renormalise (0.8/0.94 =
    # 0.851 >= 0.85) and let top_p stop at {0,1}.
    logits = np.log(np.array([0.5, 0.3, 0.14, 0.06], dtype=np.float32))
    c = filter_candidates(logits, 0, 0.85, 0.2)
    assert sorted(c.ids.tolist()) == [0, 1, 2]
    assert sorted(i for i, _ in ref_filter(logits, 0, 0.85, 0.2)) == [0, 1, 2]


# ---------------------------------------------------------------------------
# Sampled distribution matches the filtered, renormalised reference
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.8, 40, 0.95, 0.05),
    (1.0, 0, 1.0, 0.0),
    (0.5, 4, 1.0, 0.0),
    (1.7, 0, 0.8, 0.0),
    (1.2, 0, 1.0, 0.1),
])
def test_sampled_frequencies_match_reference(temperature, top_k, top_p, min_p):
    logits = random_logits(12, 11, scale=1.0)
    probs = ref_distribution(logits, temperature, top_k, top_p, min_p)
    s = make_sampler(temperature, top_k, top_p, min_p, seed=1234)
    n = 10_000
    counts = np.bincount([s(logits) for _ in range(n)], minlength=logits.size)
    assert set(np.flatnonzero(counts).tolist()) <= set(probs)   # filtered tokens never drawn
    # Pearson chi-square against the reference; 0.999 quantile of chi2(df) bounded by
    # df + 3.3*sqrt(2 df) + 10 for df <= 11 (loose but a wrong distribution blows past it).
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in probs.items())
    df = len(probs) - 1
    assert chi2 < df + 3.3 * math.sqrt(2 * max(df, 1)) + 10, (chi2, df)
    for i, p in probs.items():
        assert abs(counts[i] / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9


# ---------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------

def test_penalties_hand_computed():
    logits = np.array([2.0, -1.0, 0.5, 0.0, 3.0], dtype=np.float32)
    prev = [0, 1, 1, 3]
    out = apply_penalties(logits, prev, repeat_penalty=2.0, presence_penalty=0.25,
                          frequency_penalty=0.5, last_n=64)
    # tok0 (c=1): 2/2 - (0.5+0.25); tok1 (c=2): -1*2 - (1.0+0.25); tok3 (c=1): 0*2 - 0.75
    np.testing.assert_allclose(out, [0.25, -3.25, 0.5, -0.75, 3.0])
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 0.0, 3.0])   # input untouched
    assert out.dtype == np.float32


def test_penalties_window_last_n():
    logits = np.array([1.0, 1.0, 1.0], dtype=np.float32)
    out = apply_penalties(logits, [0, 0, 1, 2], repeat_penalty=2.0, last_n=2)
    np.testing.assert_allclose(out, [1.0, 0.5, 0.5])   # token 0 is outside the last 2
    assert np.array_equal(apply_penalties(logits, [0, 1], repeat_penalty=2.0, last_n=0), logits)


@pytest.mark.parametrize("last_n", [-1, 0, 1, 7, 64])
def test_penalties_match_reference(last_n):
    rng = np.random.default_rng(last_n + 5)
    logits = random_logits(40, last_n + 5)
    prev = rng.integers(0, 40, size=30).tolist()
    procs = make_logits_processors(1.3, 0.2, 0.4, last_n)
    out = logits
    for p in procs:
        out = p(out, prev)
    np.testing.assert_allclose(out, ref_penalties(logits, prev, 1.3, 0.2, 0.4, last_n), rtol=1e-6)


def test_neutral_penalties_add_no_processor():
    assert make_logits_processors() == []
    assert len(make_logits_processors(repeat_penalty=1.1)) == 1


def test_token_sampler_applies_penalties_before_greedy():
    logits = np.array([5.0, 4.0, 0.0], dtype=np.float32)
    sample = make_token_sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0))
    assert sample(logits, []) == 0
    assert sample(logits, [0]) == 1   # 5/2 = 2.5 < 4


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

def test_defaults_are_llama_cpp_and_valid():
    p = SamplingParams().validate()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n) == \
        (0.8, 40, 0.95, 0.05, 1.0, 64)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "hot"), ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.01), ("min_p", 1.5),
    ("repeat_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repeat_last_n", -2), ("max_tokens", -2), ("seed", -5), ("seed", 1.5),
    ("stop", "END"), ("stop", [""]), ("stop", [1]),
])
def test_invalid_parameters_raise_one_line(field, value):
    with pytest.raises(InvalidParameterError) as exc:
        SamplingParams(**{field: value}).validate()
    msg = str(exc.value)
    assert field in msg and "\n" not in msg
    assert isinstance(exc.value, EdgeInferError) and isinstance(exc.value, ValueError)


@pytest.mark.parametrize("field,value", [
    ("temperature", 0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("min_p", 1.0),
    ("seed", -1), ("seed", 0), ("max_tokens", 0), ("max_tokens", -1), ("repeat_last_n", -1),
    ("stop", ["\n\n", "</s>"]),
])
def test_boundary_values_are_accepted(field, value):
    SamplingParams(**{field: value}).validate()
