"""A bucketed runner for your own model: variable-size inputs served by a few captured graphs.

python examples/bucketed_runner.py
"""

import torch

import breakgraph
from breakgraph.runner import BucketedRunner

device = "cuda" if torch.cuda.is_available() else "cpu"
backend = "cuda" if device == "cuda" else "emulated"
torch.manual_seed(0)
w = torch.randn(32, 32, device=device)


@breakgraph.eager_on_graph
def normalise_real_rows(h):
    """Reads the live row count (the graph sees the padded bucket) from the call's context."""
    n = breakgraph.replay_context()
    out = h.clone()
    out[:n] = torch.nn.functional.normalize(h[:n], dim=0)  # statistics over real rows only
    return out


def model(x):
    return normalise_real_rows(torch.relu(x @ w)) @ w


runner = BucketedRunner(
    model,
    buckets=(8, 32, 128),
    example_inputs=(torch.randn(1, 32, device=device),),
    backend=backend,
    on_miss="eager",
    capture_context=lambda size: size,
)
for n in (3, 8, 20, 100, 300):
    x = torch.randn(n, 32, device=device)
    out = runner(x, context=n, owned=True)  # owned: survives the next call
    with breakgraph.context_scope(n):
        ok = torch.allclose(out, model(x), atol=1e-4)
    print(f"{n:>4} rows -> bucket {runner.bucket_for(n)}: matches eager: {ok}")
print(runner.stats)
