"""Finding graph bugs: debug mode, the coverage report and assert_replay_matches_eager.

python examples/debugging.py     # CUDA if available, else the emulated backend
"""

import torch

import breakgraph
from breakgraph.testing import assert_replay_matches_eager

device = "cuda" if torch.cuda.is_available() else "cpu"
backend = "cuda" if device == "cuda" else "emulated"
torch.manual_seed(0)
w = torch.randn(16, 16, device=device)


@breakgraph.eager_on_graph
def top_half(h):
    k = h.shape[1] // 2
    return h.topk(k, dim=1).values.sum(1, keepdim=True) * torch.ones_like(h)


def model(x):
    return top_half(torch.relu(x @ w)) + x


# 1. a check for your own code: capture, replay on fresh inputs, compare with eager
graph = assert_replay_matches_eager(
    model, lambda: torch.randn(4, 16, device=device), backend=backend
)
print("replays match eager;", graph)

# 2. debug mode: every replay checks that what the graph reads is still where it was
x = torch.randn(4, 16, device=device)
g = breakgraph.BreakableCUDAGraph()
with breakgraph.capture(g, backend=backend, debug=True):
    out = model(x)
for _ in range(5):
    x.copy_(torch.randn(4, 16, device=device))  # right: refill in place
    g.replay()
print(g.report())

x.set_(torch.randn(4, 16, device=device))  # wrong: the graph keeps reading the old memory
try:
    g.replay()
except breakgraph.StaleTensorError as e:
    print("caught:", str(e)[:110], "...")


# 3. a host sync inside a segment names the line and the function to decorate
def leaky(x):
    return x * (x > 0).sum().item()


try:
    with breakgraph.capture(breakgraph.BreakableCUDAGraph(), backend=backend):
        leaky(x)
except breakgraph.HostSyncError as e:
    print("caught:", str(e)[:150], "...")
