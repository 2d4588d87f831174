import torch
from helpers import words

from lamport_head.tuning.support.reference import SPECIAL, planted, reference_gather, scrub


def test_scrub_only_touches_the_sentinel_word():
    w = torch.tensor([[-0x80000000, 0x00008000, 0x3F808000, -0x80000000 | 0x3F80, 0x7FC07FC0,
                       0x7F80FF80, 0, 1]], dtype=torch.int32)
    got = words(scrub(w.view(torch.bfloat16)))
    want = w.clone()
    want[0, 0] = 0
    assert torch.equal(got, want)


def test_reference_is_cat_then_scrub():
    g = torch.Generator().manual_seed(1)
    shards = [planted(3, 16, generator=g) for _ in range(4)]
    out = reference_gather(shards)
    assert out.shape == (3, 64)
    cat = words(torch.cat(shards, 1))
    assert torch.equal(words(out), torch.where(cat == -0x80000000, 0, cat))
    assert not (words(out) == -0x80000000).any()


def test_planted_holds_every_special_word():
    x = planted(2, 64)
    present = set(words(x).flatten().tolist())
    assert set(SPECIAL) <= present
    assert x.dtype == torch.bfloat16 and x.shape == (2, 64)


def test_reference_rejects_bad_shards():
    import pytest

    with pytest.raises(ValueError):
        reference_gather([])
    with pytest.raises(ValueError):
        reference_gather([torch.zeros(2, 4, dtype=torch.int32)])
    with pytest.raises(ValueError):
        reference_gather([torch.zeros(2, 3, dtype=torch.bfloat16)])  # not whole words
    with pytest.raises(ValueError):
        reference_gather([torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16)])


def test_planted_is_deterministic_per_seed():
    def make(seed):
        return planted(4, 3, 512, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(words(make(7)), words(make(7)))
    assert not torch.equal(words(make(7)), words(make(8)))
    assert (words(make(7)) != words(make(8))).float().mean() > 0.9  # mostly random data


def test_fp32_scrub_turns_only_negative_zero_into_positive_zero():
    """FP32: the sentinel word is -0.0, which arrives as +0.0 (equal values, the one
    change); NaN payloads, ±Inf, denormals of either sign and the BF16 pair (-0, +0)
    read as an FP32 denormal arrive unchanged."""
    from lamport_head.tuning.support.reference import SPECIAL_FP32

    w = torch.tensor([SPECIAL_FP32], dtype=torch.int32)
    got = scrub(w.view(torch.float32)).view(torch.int32)
    want = w.clone()
    want[0, 0] = 0
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal(w.view(torch.float32)[0, 0], torch.tensor(-0.0))  # equal as a value


def test_fp32_reference_is_cat_then_scrub_and_planted_holds_every_special():
    from lamport_head.tuning.support.reference import SPECIAL_FP32

    g = torch.Generator().manual_seed(3)
    shards = [planted(3, 20, generator=g, dtype=torch.float32) for _ in range(2)]
    assert all(s.dtype == torch.float32 for s in shards)
    assert set(SPECIAL_FP32) <= set(torch.cat(shards).view(torch.int32).flatten().tolist())
    out = reference_gather(shards)
    assert out.dtype == torch.float32 and out.shape == (3, 40)
    cat = torch.cat(shards, 1).view(torch.int32)
    assert torch.equal(out.view(torch.int32), torch.where(cat == -0x80000000, 0, cat))


def test_the_reference_refuses_mixed_or_unserved_dtypes():
    import pytest

    with pytest.raises(ValueError):
        reference_gather([torch.zeros(2, 4, dtype=torch.float16)])
    with pytest.raises(ValueError):
        reference_gather([torch.zeros(2, 4, dtype=torch.float32),
                          torch.zeros(2, 4, dtype=torch.bfloat16)])
