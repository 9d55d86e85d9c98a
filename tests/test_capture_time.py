"""``benchmarks/capture_time.py``: its variants change one thing each and restore it (the
measurement itself needs CUDA; the GPU check runs it)."""

import pytest
import torch

from benchmarks import capture_time
from breakgraph.backends import cuda as cuda_backend


def test_each_variant_changes_one_thing_and_restores_it():
    watched = cuda_backend.CompileTransparentSegmentMode
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    seen = {}
    for variant in capture_time.VARIANTS:
        with capture_time._variant(variant):
            seen[variant] = (
                cuda_backend.CompileTransparentSegmentMode is watched,
                torch.backends.cuda.cudnn_sdp_enabled(),
            )
        assert cuda_backend.CompileTransparentSegmentMode is watched
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn
    assert seen["default"] == (True, cudnn)
    assert seen["no_sync_check"] == (False, cudnn)
    assert seen["no_cudnn_sdpa"] == (True, False)
    assert seen["neither"] == (False, False)


def test_the_ladder_summary_splits_the_first_bucket_from_the_rest():
    summary = capture_time._ladder({64: 0.5, 32: 0.02, 16: 0.04})
    assert summary["first_s"] == 0.5 and summary["buckets"] == 3
    assert abs(summary["rest_mean_s"] - 0.03) < 1e-12 and summary["rest_median_s"] == 0.03


def test_unknown_families_and_variants_are_refused_by_name(capsys):
    for argv, named in ((["--families", "llama-1b,no-such"], "no-such"),
                        (["--variants", "default,fastest"], "fastest")):  # fmt: skip
        with pytest.raises(SystemExit):
            capture_time.main(argv)
        assert named in capsys.readouterr().err
