"""benchmarks/lab/sanitize.py on the CPU: which cases --head-dims keeps (the sanitizer runs need a GPU)."""
import pytest

from scripts import load_benchmark


@pytest.fixture(scope="module")
def sanitize():
    return load_benchmark("sanitize")


def test_buckets_are_the_hopper_kernels_head_dims(sanitize):
    assert [sanitize.bucket(d) for d in (8, 40, 64, 72, 96, 120, 128, 136, 200, 256)] == [
        64, 64, 64, 128, 128, 128, 128, 256, 256, 256]


def test_head_dims_keep_their_cases_and_all_cases_by_default(sanitize):
    assert sanitize.select_cases() == sanitize.CASES
    by_bucket = {d: sanitize.select_cases({d}) for d in (64, 128, 256)}
    assert all(by_bucket.values())
    assert sorted(map(tuple, sum(by_bucket.values(), []))) == sorted(map(tuple, sanitize.CASES))
    assert {case[5] for case in by_bucket[128]} == {96, 120, 128}
    assert sanitize.select_cases({128, 256}) == [c for c in sanitize.CASES if c[5] > 64]


def test_head_dims_keep_packed_and_cache_cases(sanitize):
    for cases, index in ((sanitize.VARLEN_CASES, 3), (sanitize.KVCACHE_CASES, 6)):
        assert sanitize.select_cases(None, cases, index) == cases
        kept = sanitize.select_cases({128}, cases, index)
        assert kept and len(kept) < len(cases) and all(sanitize.bucket(case[index]) == 128 for case in kept)


def test_a_partial_build_keeps_the_cases_of_its_buckets(sanitize):
    # A build of buckets 64 and 128 raises for head dim 96 (bucket 96), not for 40 or 120 (buckets 64 and 128).
    assert [sanitize.build_bucket(d) for d in (8, 40, 64, 96, 120, 200, 256)] == [32, 64, 64, 96, 128, 224, 256]
    kept = sanitize.select_cases({64, 128}, built={64, 128})
    assert kept and all(sanitize.build_bucket(case[5]) in {64, 128} for case in kept)
    assert {case[5] for case in kept} == {40, 64, 120, 128}
    assert len(kept) < len(sanitize.select_cases({64, 128}))
    assert sanitize.select_cases(built=set(sanitize.BUILD_BUCKETS)) == sanitize.CASES
