"""What a CUDA capture refuses is refused on the emulated backend too.

Each test here runs on both backends (the CUDA one is skipped without a GPU). Every case
was a program that passed on the CPU and failed on the GPU, found by reading torch's capture
rules and checked on an H200 (torch 2.11): a tensor made from a Python list (or a list
index) inside a segment, a random draw from a generator of the user's own, a new seed, a
linalg function that reads its error code on the host, and a capture into the pool of a
deleted graph.
"""

import gc

import pytest
import torch

from breakgraph import BreakableCUDAGraph, CaptureError, HostSyncError
from tests.helpers import assert_clean, fresh_into


def _replays_like_eager(capture, static, model) -> None:
    """A capture of ``model(static)`` that replays like eager code on fresh inputs."""
    g = BreakableCUDAGraph()
    with capture(g):
        out = model(static)
    for _ in range(2):
        new = fresh_into(static)
        g.replay()
        torch.testing.assert_close(out, model(new))


# ---------------------------------------------------------------------------------------
# Host data inside a segment
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch.tensor([1.0, 2.0, 3.0], device=x.device),
        lambda x: torch.as_tensor([1.0, 2.0, 3.0], device=x.device),
        lambda x: x.new_tensor([1.0, 2.0, 3.0]),
        lambda x: x[[0, 2, 1]],
    ],
    ids=["tensor", "as_tensor", "new_tensor", "list_index"],
)
def test_an_array_of_python_data_inside_a_segment_is_a_host_sync(capture, device, make):
    """On CUDA it is a copy from pageable host memory, which torch refuses during a capture;
    the emulated backend refused nothing and replayed the values (a CPU pass, a GPU failure)."""
    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(HostSyncError, match="pinned|torch.tensor"):
        with capture(g):
            make(x) + x * 2
    assert_clean(g)


def test_a_python_number_assigned_or_an_empty_list_is_no_host_data(capture, device):
    """``y[:, 0] = 0.5`` makes a one-number tensor (a device fill on CUDA), and an empty list
    copies nothing: both are captured on both backends."""

    def model(x):
        y = x * 2
        y[:, 0] = 0.5
        return y + torch.tensor([], device=x.device).sum()

    _replays_like_eager(capture, torch.randn(3, 4, device=device), model)


# ---------------------------------------------------------------------------------------
# Random numbers
# ---------------------------------------------------------------------------------------


def test_a_generator_of_its_own_inside_a_segment_is_refused(capture, device):
    """Each segment registers the default CUDA generator alone; a draw from another one fails
    on CUDA ("Attempt to increase offset for a CUDA generator not in capture mode"). The
    default generator passed by name is the same generator, and draws afresh on replay."""
    own = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(4, device=device)
    for detect_syncs in (True, False):  # False: no watching mode on CUDA, torch's own error
        g = BreakableCUDAGraph()
        with pytest.raises(RuntimeError, match="generator"):
            with capture(g, detect_syncs=detect_syncs):
                x + torch.randn(4, device=device, generator=own)
        assert_clean(g)
    default = torch.cuda.default_generators[0] if device == "cuda" else torch.default_generator
    g = BreakableCUDAGraph()
    with capture(g):
        out = x + torch.randn(4, device=device, generator=default)
    draws = []
    for _ in range(2):
        g.replay()
        draws.append(out - x)
    assert not torch.equal(draws[0], draws[1])


def test_a_new_seed_inside_a_segment_is_refused(capture, device):
    """torch refuses to give a CUDA generator a new seed during a capture (the same seed does
    nothing), at the call and before the seed changes; so does the emulated backend."""
    torch.manual_seed(7)
    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="seed"):
        with capture(g):
            y = x * 2
            torch.manual_seed(8)
            y + 1
    assert_clean(g)
    assert torch.initial_seed() == 7
    torch.manual_seed(7)
    with capture(g):
        y = x * 2
        torch.manual_seed(7)  # the seed it has: nothing to refuse
        out = y + 1
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(out, new * 2 + 1)


# ---------------------------------------------------------------------------------------
# linalg functions that check their result on the host
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize(
    "solve",
    [
        torch.linalg.inv,
        lambda a: torch.linalg.solve(a, a[:, :1]),
        lambda a: torch.linalg.cholesky(a @ a.mT),
        lambda a: torch.linalg.eigh(a @ a.mT).eigenvalues,
        lambda a: torch.linalg.svd(a).S,
    ],
    ids=["inv", "solve", "cholesky", "eigh", "svd"],
)
def test_linalg_that_checks_on_the_host_is_a_host_sync(capture, device, solve, mode):
    """These read an error code or a cuSOLVER status on the host, inside the kernel where the
    dispatch mode cannot see it: CUDA refused them (inv, solve) or failed in cuSOLVER (eigh) on
    the H200, and the emulated backend let them pass. Both now name the call; the ``_ex``
    variants keep the code on the device and are captured."""
    a = torch.randn(4, 4, device=device) + 4 * torch.eye(4, device=device)
    with mode():
        solve(a)  # warm-up: cuSOLVER's handle
        g = BreakableCUDAGraph()
        with pytest.raises(HostSyncError, match="linalg"):
            with capture(g):
                solve(a * 2)
        assert_clean(g)
        with capture(g):
            out = torch.linalg.inv_ex(a * 2).inverse
        new = torch.randn(4, 4, device=device) + 4 * torch.eye(4, device=device)
        a.copy_(new)
        g.replay()
        torch.testing.assert_close(out, torch.linalg.inv(new * 2))


# ---------------------------------------------------------------------------------------
# Pools
# ---------------------------------------------------------------------------------------


def test_a_pool_is_given_up_when_its_last_graph_is_deleted(capture, device):
    """A CUDAGraph's destructor resets it, so deleting the last graph of a pool gives the pool
    up as a reset does; the emulated pool counted resets only and took the next capture."""
    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        out = x * 2  # kept: the pool's memory is still in use
    pool = g.pool()
    del g
    gc.collect()
    with pytest.raises(CaptureError, match="has no live graph any more"):
        with capture(BreakableCUDAGraph(), pool=pool):
            x + 1
    assert_clean()
    assert out.shape == (4,)
