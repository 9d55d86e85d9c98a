"""The core API on a toy model: eager breaks, replay, per-replay host state, copy-back.

python examples/basics.py          # CUDA if available, else the emulated backend
"""

import torch

import breakgraph

device = "cuda" if torch.cuda.is_available() else "cpu"
backend = "cuda" if device == "cuda" else "emulated"
torch.manual_seed(0)
w1, w2 = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)


@breakgraph.eager_on_graph
def keep_top_rows(h):
    """Host-dependent work: the number of rows kept comes from the live batch.

    Eager functions are re-called on replay with their capture-time arguments, so
    anything that changes per step is read from breakgraph.replay_context().
    """
    k = breakgraph.replay_context()["rows"]
    scores = h.norm(dim=1)
    keep = scores.topk(k).indices.sort().values.tolist()  # a host sync: fine in a break
    out = torch.zeros_like(h)
    out[keep] = h[keep]
    return out


def model(x):
    h = torch.relu(x @ w1)  # captured
    h = keep_top_rows(h)  # eager, every replay
    return torch.tanh(h @ w2)  # captured


static_x = torch.randn(16, 64, device=device)
with breakgraph.context_scope({"rows": 4}):
    model(static_x)  # warm up (libraries choose their algorithms on the first call)

g = breakgraph.BreakableCUDAGraph()
with breakgraph.capture(g, backend=backend, context={"rows": 4}):
    static_out = model(static_x)
print(g)

for rows in (2, 8, 16):
    x = torch.randn(16, 64, device=device)
    static_x.copy_(x)  # refresh the static input in place
    g.replay(context={"rows": rows})  # the per-step host state
    with breakgraph.context_scope({"rows": rows}):
        expected = model(x)  # the same function, run eagerly
    print(
        f"rows={rows:>2}: replay matches eager: {torch.allclose(static_out, expected, atol=1e-5)}"
    )


@breakgraph.eager_on_graph
def bad_shape(h):
    n = breakgraph.replay_context()["rows"]
    return h[:n]  # the shape follows the batch: not allowed


g2 = breakgraph.BreakableCUDAGraph()
with breakgraph.capture(g2, backend=backend, context={"rows": 4}):
    y = bad_shape(static_x) * 2
try:
    g2.replay(context={"rows": 3})
except breakgraph.CopyBackError as e:
    print("copy-back refused:", str(e).split(". ")[0])
